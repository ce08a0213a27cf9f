"""The example scripts on released-format LLaDA / Dream checkpoints with the user's own data files: a setting the
model's family refuses, or a data file without the columns a script needs, is found only once the model and the
data are loaded; it stopped the run with a traceback (exit 1) instead of the one line, exit 2, that the scripts
promise for a bad argument."""

import json

import pytest
from test_cli import load_example
from test_review2_loading import DREAM_IDS, LLADA_IDS, write_dream_tokenizer, write_llada_tokenizer, write_released

from trl_diffusion.scripts.utils import run_script

WRITERS = {"llada": (LLADA_IDS, write_llada_tokenizer), "dream": (DREAM_IDS, write_dream_tokenizer)}


def released(family, tmp_path):
    ids, write_tokenizer = WRITERS[family]
    directory = tmp_path / family
    write_released(family, directory, shards=1, **ids)
    write_tokenizer(directory)
    return directory


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


MATH_ROWS = [{"question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(4)]
CODE_ROWS = [{"prompt": [{"role": "user", "content": f"Write f() returning {i}."}], "tests": [f"assert f() == {i}"]}
             for i in range(4)]
SFT_ROWS = [{"prompt": [{"role": "user", "content": f"{i}+{i}?"}],
             "completion": [{"role": "assistant", "content": str(2 * i)}]} for i in range(4)]


@pytest.mark.parametrize("family,name,rows,flags,expected", [
    ("llada", "math", MATH_ROWS, ["--training_block_size", "8"], "training_block_size=8 was set, but the model has "
                                                                 "full attention"),
    ("dream", "code", CODE_ROWS, ["--training_block_size", "4"], "training_block_size=4 was set"),
    ("llada", "sft", SFT_ROWS, ["--block_size", "4"], "block_size=4 was set, but the model has full attention"),
    ("dream", "sft", SFT_ROWS, ["--diffusion_objective", "block"], "diffusion_objective='block' needs a "
                                                                     "block-causal model"),
    ("llada", "math", CODE_ROWS, [], "need a problem/question column and an answer/solution column"),
    ("dream", "code", MATH_ROWS, [], "no 'prompt' column"),
], ids=["llada-math-training_block_size", "dream-code-training_block_size", "llada-sft-block_size",
        "dream-sft-block_objective", "llada-math-code_file", "dream-code-math_file"])
def test_family_and_data_errors_are_one_line_exit_2(tmp_path, capsys, family, name, rows, flags, expected):
    checkpoint = released(family, tmp_path)
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    argv = ["--model_name_or_path", str(checkpoint), "--dataset_name", str(data), "--output_dir",
            str(tmp_path / "out"), "--max_steps", "1", "--per_device_train_batch_size", "4", "--use_cpu", "true",
            "--bf16", "false", *flags]
    if name != "sft":
        argv += ["--num_generations", "4", "--max_completion_length", "8"]
    example = load_example(name)
    with pytest.raises(SystemExit) as exit_info:
        run_script(example.main, example.make_parser(), argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(f"{example.make_parser().prog}: error: ") and expected in err[-1], err[-3:]
    assert "Traceback" not in "\n".join(err)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # stopped before training
