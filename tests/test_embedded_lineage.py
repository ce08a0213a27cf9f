"""A model trained from the embedded one (``outputs/math`` after an example, its checkpoints, a copy) wants the same
plain prompts: ``trl-diffusion eval`` and the examples treat it as the embedded model (before, it counted as another
model, took the chat template by default and scored 0)."""

from __future__ import annotations

import json
import shutil

import pytest
from example_scripts import load_example
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_diffusion.assets import EMBEDDED_MODEL, is_embedded_model
from trl_diffusion.eval import evaluate
from trl_diffusion.scripts.utils import run_script
from trl_diffusion.testing import tiny_model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The embedded model saved elsewhere by ``save_pretrained``, as a trainer's ``save_model`` writes it."""
    folder = tmp_path_factory.mktemp("outputs") / "math"
    AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL).save_pretrained(folder)
    AutoTokenizer.from_pretrained(EMBEDDED_MODEL).save_pretrained(folder)
    return folder


def test_the_embedded_model_and_what_is_trained_from_it(trained, tmp_path):
    assert is_embedded_model(EMBEDDED_MODEL) and is_embedded_model(str(EMBEDDED_MODEL))
    assert is_embedded_model(trained) and is_embedded_model(AutoModelForCausalLM.from_pretrained(trained).config)
    checkpoint = tmp_path / "checkpoint-5"  # a checkpoint folder: read by its config.json
    shutil.copytree(trained, checkpoint, ignore=shutil.ignore_patterns("*.safetensors"))
    assert is_embedded_model(checkpoint)


def test_other_models_are_not_the_embedded_one(trained, tmp_path):
    assert not is_embedded_model(tiny_model("sdar").config)  # the same tokenizer, another shape
    assert not is_embedded_model(tiny_model("llada").config)
    wider = json.loads((trained / "config.json").read_text()) | {"hidden_size": 256}
    (tmp_path / "wider").mkdir()
    (tmp_path / "wider" / "config.json").write_text(json.dumps(wider))
    assert not is_embedded_model(tmp_path / "wider")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert not is_embedded_model(tmp_path / "broken")
    assert not is_embedded_model(tmp_path)  # no config.json
    for name in ("Gen-Verse/TraDo-4B-Instruct", "", None):  # a Hub id is not read
        assert not is_embedded_model(name)


def test_eval_of_a_trained_copy_defaults_to_the_plain_prompts(trained, caplog):
    """``trl-diffusion eval --model_name_or_path outputs/math``, no flag: the embedded model's plain prompts, so it
    scores what it scores with ``--apply_chat_template false`` (through the chat template it scores 0)."""
    kwargs = dict(max_problems=40, output_dir="", progress=False)
    default = evaluate(model_name_or_path=str(trained), **kwargs)
    plain = evaluate(model_name_or_path=str(trained), apply_chat_template=False, **kwargs)
    assert default["apply_chat_template"] is False
    assert default["metrics"]["accuracy"] == plain["metrics"]["accuracy"] > 0
    model, tokenizer = AutoModelForCausalLM.from_pretrained(trained), AutoTokenizer.from_pretrained(trained)
    loaded = evaluate(model=model, tokenizer=tokenizer, **kwargs)  # a loaded model: by its config
    assert loaded["apply_chat_template"] is False
    assert loaded["metrics"]["accuracy"] == default["metrics"]["accuracy"]


def test_code_example_turns_a_trained_copys_answers_into_programs(trained, tmp_path):
    """``examples/code.py --model_name_or_path outputs/math``: the model still answers ``\\boxed{579}``, which the
    example turns into ``def f(): return 579`` for the sandbox, as for the embedded model (before: chat prompts it
    does not know, its answers run as code, every reward 0)."""
    example = load_example("code")
    result = run_script(example.main, example.make_parser(), [
        "--model_name_or_path", str(trained), "--max_steps", "1", "--per_device_train_batch_size", "16",
        "--num_generations", "4", "--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--report_to", "none"])
    assert result["reward_first"] > 0


def test_a_lora_adapter_is_judged_by_its_base_model(tmp_path):
    """``examples/math.py --use_peft`` saves an adapter folder (no config.json): trained from the embedded model when
    its ``base_model_name_or_path`` is; eval then takes the plain prompts and scores like the base (LoRA's B = 0)."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL)
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(tmp_path / "lora")
    AutoTokenizer.from_pretrained(EMBEDDED_MODEL).save_pretrained(tmp_path / "lora")
    assert not (tmp_path / "lora" / "config.json").exists() and is_embedded_model(tmp_path / "lora")
    kwargs = dict(max_problems=40, output_dir="", progress=False)
    report = evaluate(model_name_or_path=str(tmp_path / "lora"), **kwargs)
    assert report["apply_chat_template"] is False
    assert report["metrics"]["accuracy"] == evaluate(model_name_or_path=str(EMBEDDED_MODEL), **kwargs)["metrics"][
        "accuracy"] > 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "x/y"}))
    assert not is_embedded_model(tmp_path / "other")
    (tmp_path / "other" / "adapter_config.json").write_text("[]")
    assert not is_embedded_model(tmp_path / "other")
