"""Examples and recipes: every recipe parses with its example's TrlParser, and the examples run end to end on the
embedded model (tiny settings), report held-out accuracies that can be recomputed, and save their training curves."""

import json
from pathlib import Path

import pytest
from example_scripts import load_example
from PIL import Image
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_diffusion.assets import EMBEDDED_CHAT_TEMPLATE, EMBEDDED_MODEL, EMBEDDED_TASK
from trl_diffusion.data import evaluate_accuracy, make_problems
from trl_diffusion.scripts.utils import run_script

ROOT = Path(__file__).parent.parent
RECIPES = sorted((ROOT / "trl_diffusion" / "recipes").glob("*.yaml"))
EXAMPLE_OF = {"sft": "sft", "code": "code"}


def example_for(recipe: Path) -> str:
    return next((v for k, v in EXAMPLE_OF.items() if k in recipe.stem), "math")


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipes_parse(recipe):
    parser = load_example(example_for(recipe)).make_parser()
    script_args, training_args, model_args = parser.parse_args_and_config(
        ["--config", str(recipe), "--bf16", "false", "--tf32", "false", "--use_cpu", "true"])
    assert model_args.model_name_or_path
    assert training_args.output_dir.startswith("outputs/")


@pytest.mark.slow
@pytest.mark.parametrize("name,extra", [
    ("math", ["--max_steps", "2", "--per_device_train_batch_size", "16", "--num_generations", "4",
              "--num_eval", "20", "--eval_every", "1", "--logging_steps", "1"]),
    ("sft", ["--max_steps", "3", "--per_device_train_batch_size", "32", "--num_eval", "20", "--eval_every", "2",
             "--logging_steps", "1", "--max_train_samples", "128"]),
    ("code", ["--max_steps", "1", "--per_device_train_batch_size", "4", "--num_generations", "4"]),
])
def test_example_runs(tmp_path, capsys, name, extra):
    """The example trains, saves a model and a curves PNG holding a point per logged step; the held-out accuracy it
    reports before and after equals the embedded model's and the saved model's accuracy recomputed here. It runs in
    this process (``run_script``, as the script's ``__main__`` does; the same kernels and greedy decisions as the
    recomputation): docs/quickstart.md's smoke-run block, which the suite runs, launches the same three scripts as
    commands."""
    example = load_example(name)
    returned = run_script(example.main, example.make_parser(), ["--output_dir", str(tmp_path), "--use_cpu", "true",
                                                                *extra])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # the line a user reads
    assert result == json.loads(json.dumps(returned))
    curves = json.loads(Image.open(result["training_curves"]).text["Curves"])
    steps = int(extra[extra.index("--max_steps") + 1])
    assert [step for step, _ in curves["loss" if name == "sft" else "reward"]] == list(range(1, steps + 1))
    assert (tmp_path / "model.safetensors").is_file()
    if name == "code":
        return
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    held_out = make_problems(**EMBEDDED_TASK)[1][:20]
    accuracy = {which: evaluate_accuracy(AutoModelForCausalLM.from_pretrained(path), tokenizer, held_out,
                                         chat_template=EMBEDDED_CHAT_TEMPLATE)
                for which, path in (("before", EMBEDDED_MODEL), ("after", tmp_path))}
    assert result["held_out_accuracy_before"] == pytest.approx(accuracy["before"], abs=1e-4)  # reported rounded
    assert result["held_out_accuracy_after"] == pytest.approx(accuracy["after"], abs=1e-4)
    assert curves["eval/held_out_accuracy"][-1] == [steps, pytest.approx(accuracy["after"])]
    if name == "math":  # the curve it reports is the one it plotted, starting point (step 0) included
        assert [step for step, _ in result["accuracy_curve"]] == list(range(steps + 1))
        assert result["accuracy_curve"] == [[s, pytest.approx(a, abs=1e-4)]
                                            for s, a in curves["eval/held_out_accuracy"]]


def test_sft_example_max_train_samples_takes_the_first_rows(monkeypatch):
    """``--max_train_samples N`` hands the trainer the first N training examples (all without it); 0 is refused."""
    from trl_diffusion.scripts.utils import parse_script_args

    example = load_example("sft")
    seen = []

    class Stop(Exception):
        pass

    def trainer(model, args, train_dataset, **kwargs):
        seen.append(train_dataset)
        raise Stop

    monkeypatch.setattr(example, "DiffusionSFTTrainer", trainer)
    for extra in (["--max_train_samples", "5"], []):
        parsed = parse_script_args(example.make_parser(), ["--output_dir", "unused", "--use_cpu", "true", *extra])
        with pytest.raises(Stop):
            example.main(*parsed)
    train = make_problems(**EMBEDDED_TASK)[0]
    assert len(seen[0]) == 5 and len(seen[1]) == len(train) > 5
    assert seen[0][:] == seen[1].select(range(5))[:]
    with pytest.raises(SystemExit):
        parse_script_args(example.make_parser(), ["--output_dir", "unused", "--max_train_samples", "0"])
