"""Examples and recipes: every recipe parses with its example's TrlParser, and the examples run end to end on the
embedded model (tiny settings) and save their training curves."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
EXAMPLE_OF = {"sft": "sft", "code": "code"}


def load_example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


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
              "--num_eval", "20", "--eval_every", "1"]),
    ("sft", ["--max_steps", "3", "--per_device_train_batch_size", "32", "--num_eval", "20", "--eval_every", "2"]),
    ("code", ["--max_steps", "1", "--per_device_train_batch_size", "4", "--num_generations", "4"]),
])
def test_example_runs(tmp_path, name, extra):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py"), "--output_dir", str(tmp_path),
                          "--use_cpu", "true", *extra], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(result["training_curves"]).is_file()
    assert (tmp_path / "model.safetensors").is_file()
    if name in ("math", "sft"):
        assert 0.0 <= result["held_out_accuracy_before"] <= 1.0
        assert 0.0 <= result["held_out_accuracy_after"] <= 1.0
