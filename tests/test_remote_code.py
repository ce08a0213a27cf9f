"""What we save stays loadable by the released remote code: a folder saved from a released checkpoint carries the
``.py`` files its ``auto_map`` names (or points them at the Hub repository it came from), so
``trust_remote_code=True`` without trl_diffusion (dLLM-RL's scripts, the model cards' snippets) loads it."""

import json
import shutil
import subprocess
import sys

import huggingface_hub
import pytest
import torch
from datasets import Dataset
from test_review2_loading import DREAM_IDS, RELEASED_EXTRAS, write_dream_tokenizer, write_released
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.testing_utils import CaptureLogger

from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer, TraceRLConfig, TraceRLTrainer
from trl_diffusion.models import carry_remote_code, carry_tokenizer_code
from trl_diffusion.models.remote_code import logger

FAMILIES = ["sdar", "llada", "dream"]
MODEL_TYPES = {"sdar": "sdar", "llada": "llada", "dream": "Dream"}


def write_stand_in_code(directory, family: str) -> dict[str, str]:
    """Stand-ins for a release's remote code, one module per ``auto_map`` file; the modeling module imports a helper
    relatively, as SDAR's imports its fused cross-entropy module. Returns {file name: text}."""
    references = list(RELEASED_EXTRAS[family]["auto_map"].values())
    config_module, config_class = next(r for r in references if r.startswith("configuration_")).split(".")
    model_module = next(r for r in references if r.startswith("modeling_")).split(".")[0]
    model_classes = sorted({r.split(".")[1] for r in references if r.startswith("modeling_")})
    files = {
        f"{config_module}.py": "from transformers import PretrainedConfig\n\n\n"
                               f"class {config_class}(PretrainedConfig):\n    model_type = {MODEL_TYPES[family]!r}\n",
        f"released_helper_{family}.py": f"MARKER = 'released {family} code'\n",
        f"{model_module}.py": "from transformers import PreTrainedModel\n\n"
                              f"from .{config_module} import {config_class}\nfrom .released_helper_{family} import "
                              "MARKER\n" + "".join(f"\n\nclass {name}(PreTrainedModel):\n    config_class = "
                                                   f"{config_class}\n    marker = MARKER\n" for name in model_classes),
        "unrelated_script.py": "raise SystemExit('not part of the model code')\n",
    }
    if family == "dream":
        files["tokenization_dream.py"] = ("from transformers import Qwen2Tokenizer\n\n\nclass DreamTokenizer("
                                          "Qwen2Tokenizer):\n    marker = 'released dream tokenizer'\n")
    for name, text in files.items():
        (directory / name).write_text(text)
    return files


def load_without_trl_diffusion(folders: list) -> list[dict]:
    """Each folder loaded in a fresh interpreter that never imports trl_diffusion, with trust_remote_code=True: the
    config class and every auto_map class, as the released code's users load them."""
    script = """
import json, os, sys
from transformers import AutoConfig, AutoTokenizer
from transformers.dynamic_module_utils import get_class_from_dynamic_module
report = []
for folder in sys.argv[1:]:
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    models = [get_class_from_dynamic_module(r, folder) for k, r in config.auto_map.items() if k != "AutoConfig"]
    entry = {"config_module": type(config).__module__, "markers": sorted({getattr(c, "marker", "") for c in models})}
    path = os.path.join(folder, "tokenizer_config.json")
    if os.path.exists(path) and "auto_map" in json.load(open(path)):
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        entry["tokenizer_marker"] = getattr(tokenizer, "marker", "")
    report.append(entry)
assert "trl_diffusion" not in sys.modules
print(json.dumps(report))
"""
    done = subprocess.run([sys.executable, "-c", script, *map(str, folders)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_saved_folders_load_in_the_released_code(tmp_path):
    """Before: the saved config.json named configuration_*.py / modeling_*.py, which the folder did not have, and
    trust_remote_code=True without trl_diffusion raised "does not appear to have a file named ...". Now the files
    come along byte for byte (and the module they import relatively, not unrelated scripts), and our own classes
    still load the saved folder with its weights."""
    saved = []
    for family in FAMILIES:
        release = tmp_path / family
        extra = DREAM_IDS if family == "dream" else {}
        write_released(family, release, **extra)
        files = write_stand_in_code(release, family)
        model = AutoModelForCausalLM.from_pretrained(release)
        model.save_pretrained(tmp_path / f"{family}-saved")
        folder = tmp_path / f"{family}-saved"
        copied = {p.name for p in folder.glob("*.py")}
        assert copied == set(files) - {"unrelated_script.py", "tokenization_dream.py"}, copied
        for name in copied:
            assert (folder / name).read_bytes() == (release / name).read_bytes()
        assert json.loads((folder / "config.json").read_text())["auto_map"] == RELEASED_EXTRAS[family]["auto_map"]
        again = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        assert type(again) is type(model)
        ids = torch.randint(4, 60, (1, 8))
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)
        saved.append(folder)
    report = load_without_trl_diffusion(saved)
    for family, entry in zip(FAMILIES, report):
        assert entry["config_module"].startswith("transformers_modules"), entry
        assert entry["markers"] == [f"released {family} code"], entry


def hub_snapshot(cache, repo_id: str):
    """The Hub cache's folder for ``repo_id`` at ``main`` (what ``from_pretrained(repo_id)`` downloads into)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    return repo / "snapshots" / ("a" * 40)


def test_hub_source_points_the_auto_map_at_its_repository(tmp_path, monkeypatch):
    """A model loaded from the Hub (offline, from the Hub cache; we never download the .py files): the saved
    references name the source repository (transformers' "repo--module.Class"), which trust_remote_code resolves
    there; our classes still load the folder offline, with or without trust_remote_code; the tokenizer's [slow, fast]
    references likewise."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = hub_snapshot(tmp_path / "hub", "Dream-org/Dream-v0-Instruct-7B")
    write_released("dream", snapshot, **DREAM_IDS)
    write_dream_tokenizer(snapshot)
    model = AutoModelForCausalLM.from_pretrained("Dream-org/Dream-v0-Instruct-7B")
    tokenizer = AutoTokenizer.from_pretrained("Dream-org/Dream-v0-Instruct-7B")
    model.save_pretrained(tmp_path / "saved")
    tokenizer.save_pretrained(tmp_path / "saved")
    carry_tokenizer_code(tmp_path / "saved", tokenizer)
    auto_map = json.loads((tmp_path / "saved" / "config.json").read_text())["auto_map"]
    assert auto_map == {key: f"Dream-org/Dream-v0-Instruct-7B--{ref}"
                        for key, ref in RELEASED_EXTRAS["dream"]["auto_map"].items()}
    assert json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())["auto_map"] == {
        "AutoTokenizer": ["Dream-org/Dream-v0-Instruct-7B--tokenization_dream.DreamTokenizer", None]}
    assert model.config.auto_map == RELEASED_EXTRAS["dream"]["auto_map"]  # the live config is left as loaded
    for trust in (False, True):
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", trust_remote_code=trust)
        assert type(again) is type(model)
    again.save_pretrained(tmp_path / "twice")  # repository references are kept as they are
    assert json.loads((tmp_path / "twice" / "config.json").read_text())["auto_map"] == auto_map


def test_a_vanished_relative_source_is_not_taken_for_a_repository(tmp_path, monkeypatch):
    """``out/checkpoint-500`` (a relative path, since deleted) reads like a repository name: no "repo--" reference
    may be made up from it; the user is warned instead."""
    monkeypatch.chdir(tmp_path)
    write_released("sdar", tmp_path / "out" / "checkpoint-500")
    model = AutoModelForCausalLM.from_pretrained("out/checkpoint-500")
    shutil.rmtree(tmp_path / "out")
    with CaptureLogger(logger) as captured:
        model.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["auto_map"] == \
        RELEASED_EXTRAS["sdar"]["auto_map"]
    assert "configuration_sdar.py, modeling_sdar.py" in captured.out and "out/checkpoint-500" in captured.out


def test_a_source_without_the_code_is_named_in_a_warning(tmp_path):
    """A release downloaded without its .py files: nothing to copy, so the user is told which files are missing."""
    write_released("llada", tmp_path / "weights-only")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "weights-only")
    with CaptureLogger(logger) as captured:
        model.save_pretrained(tmp_path / "saved")
    assert "configuration_llada.py, modeling_llada.py" in captured.out
    assert "trust_remote_code=True cannot load" in captured.out
    with CaptureLogger(logger) as captured:  # a model built from a config has no auto_map: nothing to say
        carry_remote_code(tmp_path / "saved", None, "generation_config.json")
    assert captured.out == ""


def dream_release_with_tokenizer(tmp_path):
    release = tmp_path / "dream"
    write_released("dream", release, **DREAM_IDS)
    write_dream_tokenizer(release)
    write_stand_in_code(release, "dream")
    return AutoModelForCausalLM.from_pretrained(release), AutoTokenizer.from_pretrained(release)


CPU = dict(report_to="none", use_cpu=True, bf16=False, disable_tqdm=True, save_strategy="no")


@pytest.mark.parametrize("trainer_name", ["sft", "tracerl"])
def test_trainer_saves_carry_model_and_tokenizer_code(tmp_path, trainer_name):
    """``save_model`` (also what checkpoints and ``push_to_hub`` write) of both policy trainers: the folder has the
    release's model and tokenizer code, and the released code loads both without trl_diffusion."""
    model, tokenizer = dream_release_with_tokenizer(tmp_path)
    out = tmp_path / "out"
    if trainer_name == "sft":
        args = DiffusionSFTConfig(output_dir=str(out), max_length=32, **CPU)
        data = Dataset.from_dict({"prompt": ["ab"] * 2, "completion": ["cd"] * 2})
        trainer = DiffusionSFTTrainer(model, args=args, train_dataset=data, processing_class=tokenizer)
    else:
        args = TraceRLConfig(output_dir=str(out), per_device_train_batch_size=2, num_generations=2,
                             max_completion_length=4, block_length=2, denoising_steps=2, **CPU)
        trainer = TraceRLTrainer(model, lambda completions, **kw: [0.0] * len(completions), args=args,
                                 processing_class=tokenizer, train_dataset=Dataset.from_dict({"prompt": ["ab"] * 2}))
    trainer.save_model()
    assert {"configuration_dream.py", "modeling_dream.py", "released_helper_dream.py",
            "tokenization_dream.py"} <= {p.name for p in out.glob("*.py")}
    [entry] = load_without_trl_diffusion([out])
    assert entry["markers"] == ["released dream code"]
    assert entry["tokenizer_marker"] == "released dream tokenizer"


def test_hub_source_with_the_code_in_its_cached_snapshot_is_copied(tmp_path, monkeypatch):
    """A repository downloaded whole (``snapshot_download``, or loaded once with trust_remote_code): the saved folder
    gets the code copied from the cached snapshot, with the auto_map as released, so it loads offline without a
    reference back to the Hub; a snapshot missing a relatively imported file keeps the repository references."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = hub_snapshot(tmp_path / "hub", "JetLM/SDAR-1.7B-Chat")
    write_released("sdar", snapshot)
    files = write_stand_in_code(snapshot, "sdar")
    model = AutoModelForCausalLM.from_pretrained("JetLM/SDAR-1.7B-Chat")
    model.save_pretrained(tmp_path / "saved")
    copied = {p.name for p in (tmp_path / "saved").glob("*.py")}
    assert copied == set(files) - {"unrelated_script.py"}, copied
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["auto_map"] == \
        RELEASED_EXTRAS["sdar"]["auto_map"]
    (entry,) = load_without_trl_diffusion([tmp_path / "saved"])
    assert entry["markers"] == ["released sdar code"], entry

    (snapshot / "released_helper_sdar.py").unlink()  # incomplete: copying would leave a broken import
    model.save_pretrained(tmp_path / "saved-incomplete")
    assert not list((tmp_path / "saved-incomplete").glob("*.py"))
    assert all(ref.startswith("JetLM/SDAR-1.7B-Chat--") for ref in
               json.loads((tmp_path / "saved-incomplete" / "config.json").read_text())["auto_map"].values())


def test_a_process_that_does_not_save_copies_no_tokenizer_code(tmp_path, monkeypatch):
    # transformers calls _save on every process under FSDP and DeepSpeed and writes only where should_save: the SFT
    # trainer's tokenizer-code copy ran on every process (files written into the same folder as rank 0's)
    from trl_diffusion.testing import build_tokenizer, tiny_model

    release, out = tmp_path / "release", tmp_path / "out"
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(release)
    (release / "tokenization_tiny.py").write_text("# released tokenizer code\n")
    config = json.loads((release / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_tiny.TinyTokenizerFast"]}
    (release / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer.name_or_path = str(release)
    args = DiffusionSFTConfig(str(out), report_to="none", use_cpu=True, bf16=False, save_strategy="no")
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=args, processing_class=tokenizer,
                                  train_dataset=Dataset.from_dict({"prompt": ["1+2="], "completion": ["3"]}))
    base = tmp_path / "base"  # what transformers' own _save writes there (5.20: the model; it ran on savers only)
    for folder in (out, base):
        folder.mkdir(exist_ok=True)
        shutil.copy(release / "tokenizer_config.json", folder)  # as the writing process has just saved it
    monkeypatch.setattr(DiffusionSFTConfig, "should_save", property(lambda self: False))
    trainer._save(str(out))
    super(DiffusionSFTTrainer, trainer)._save(str(base))
    assert sorted(path.name for path in out.iterdir()) == sorted(path.name for path in base.iterdir())
    assert "tokenization_tiny.py" not in {path.name for path in out.iterdir()}
