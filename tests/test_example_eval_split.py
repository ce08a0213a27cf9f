"""``--eval_strategy steps`` in the examples evaluates as TRL's scripts do (it was transformers' "you didn't pass an
eval_dataset" error): on the synthetic task's held-out problems, or on ``--dataset_test_split`` of a dataset; a local
file (one split, ``train``) needs its slices named, which the error says."""

import json

import pytest
from example_scripts import load_example

from trl_diffusion.scripts.utils import parse_script_args, run_script

EVAL = ["--use_cpu", "true", "--max_steps", "1", "--eval_strategy", "steps", "--eval_steps", "1", "--save_strategy",
        "no"]
RL = ["--per_device_train_batch_size", "8", "--num_generations", "4", "--per_device_eval_batch_size", "4",
      "--num_eval", "4"]


def trained(name: str, argv: list[str], monkeypatch):
    """The trainer ``examples/<name>.py`` built and trained with ``argv``."""
    example = load_example(name)
    trainer_class = "DiffusionSFTTrainer" if name == "sft" else "TraceRLTrainer"
    original, seen = getattr(example, trainer_class), []
    monkeypatch.setattr(example, trainer_class, lambda *args, **kwargs: seen.append(original(*args, **kwargs))
                        or seen[-1])
    example.main(*parse_script_args(example.make_parser(), argv))
    return seen[0]


@pytest.mark.parametrize("name,metric", [("math", "eval_reward"), ("code", "eval_reward"), ("sft", "eval_loss")])
def test_the_synthetic_task_is_evaluated_on_its_held_out_problems(tmp_path, name, metric, monkeypatch):
    # SFT: not all 12,000 training problems prepared for a one-step run (~10 s on two cores)
    extra = ["--num_eval", "4", "--per_device_train_batch_size", "8", "--max_train_samples", "64"] if name == "sft" \
        else RL
    trainer = trained(name, ["--output_dir", str(tmp_path), *EVAL, *extra], monkeypatch)
    assert len(trainer.eval_dataset) == 4
    assert any(metric in entry for entry in trainer.state.log_history)


def test_a_local_file_is_evaluated_on_the_slice_it_is_given(tmp_path, capsys, monkeypatch):
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i}+1?", "answer": str(i + 1)}) + "\n"
                            for i in range(16)))
    argv = ["--output_dir", str(tmp_path / "out"), "--dataset_name", str(data), *EVAL, *RL]
    example = load_example("math")
    with pytest.raises(SystemExit):
        run_script(example.main, example.make_parser(), argv)
    assert "dataset_test_split='test': the local file" in capsys.readouterr().err
    trainer = trained("math", [*argv, "--dataset_train_split", "train[:12]", "--dataset_test_split", "train[12:]"],
                      monkeypatch)
    assert len(trainer.train_dataset) == 12 and len(trainer.eval_dataset) == 4
    assert any("eval_reward" in entry for entry in trainer.state.log_history)
