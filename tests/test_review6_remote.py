"""Review 6: mid-training Hub pushes carry the released remote code, and the "missing code" warning is said once.

transformers' ``Trainer._push_from_checkpoint`` (``push_to_hub=True`` with a saving ``hub_strategy``) copies a fixed
list of files from the checkpoint into ``output_dir``, re-saves the tokenizer there and uploads ``output_dir``:
the ``.py`` files a checkpoint carries (``tests/test_remote_code.py``) were left behind, and a Hub source's
``"repo--"`` tokenizer references were written back as loaded. The upload is a stand-in that records what the
folder holds when the upload starts (transformers runs it in the background at once)."""

import json
import shutil
from concurrent.futures import Future

import huggingface_hub.constants
import pytest
import transformers.trainer
from datasets import Dataset
from test_remote_code import dream_release_with_tokenizer, hub_snapshot, load_without_trl_diffusion
from test_review2_loading import DREAM_IDS, RELEASED_EXTRAS, write_dream_tokenizer, write_released
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.testing_utils import CaptureLogger

from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer, TraceRLConfig, TraceRLTrainer
from trl_diffusion.models.remote_code import logger
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

DREAM_CODE = {"configuration_dream.py", "modeling_dream.py", "released_helper_dream.py", "tokenization_dream.py"}
CPU = dict(report_to="none", use_cpu=True, bf16=False, disable_tqdm=True)
HUB = dict(push_to_hub=True, hub_model_id="me/tiny", hub_strategy="every_save")


class RecordingHub:
    """Stands in for transformers' ``hf_api()``: each ``upload_folder`` copies the folder as it is when the upload
    starts into ``root/<n>`` and returns a finished future."""

    def __init__(self, root):
        self.root, self.uploads = root, []

    def create_repo(self, repo_id, **kwargs):
        return type("Repo", (), {"repo_id": repo_id})()

    def upload_folder(self, repo_id, folder_path, ignore_patterns=(), **kwargs):
        target = self.root / str(len(self.uploads))
        shutil.copytree(folder_path, target, ignore=shutil.ignore_patterns(*(ignore_patterns or ())))
        self.uploads.append(target)
        done = Future()
        done.set_result(None)
        return done


@pytest.fixture
def hub(tmp_path, monkeypatch):
    recording = RecordingHub(tmp_path / "uploads")
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: recording)
    return recording


def make_trainer(name: str, model, tokenizer, out, **extra):
    """An SFT, TraceRL or value trainer on a Dream release's model and tokenizer, pushing every save (``extra``
    overrides the settings)."""
    extra = {**CPU, **HUB, **extra}
    if name == "sft":
        args = DiffusionSFTConfig(output_dir=str(out), max_length=32, **extra)
        data = Dataset.from_dict({"prompt": ["ab"] * 2, "completion": ["cd"] * 2})
        return DiffusionSFTTrainer(model, args=args, train_dataset=data, processing_class=tokenizer)
    if name == "tracerl":
        args = TraceRLConfig(output_dir=str(out), per_device_train_batch_size=2, num_generations=2,
                             max_completion_length=4, block_length=2, denoising_steps=2, **extra)
        return TraceRLTrainer(model, lambda completions, **kw: [0.0] * len(completions), args=args,
                              processing_class=tokenizer, train_dataset=Dataset.from_dict({"prompt": ["ab"] * 2}))
    args = DiffusionValueConfig(output_dir=str(out), **extra)
    return DiffusionValueTrainer(DiffusionValueModel.from_policy(model), args=args, processing_class=tokenizer)


def push_checkpoint(trainer, out) -> None:
    """What ``Trainer._save_checkpoint`` does for a push: save the checkpoint, then push from it."""
    checkpoint = out / "checkpoint-1"
    trainer.save_model(str(checkpoint), _internal_call=True)  # as _save_checkpoint saves: no push of its own
    trainer._push_from_checkpoint(str(checkpoint))


@pytest.mark.parametrize("name", ["sft", "tracerl", "value"])
def test_mid_training_push_uploads_the_local_release_code(tmp_path, hub, name):
    """Before: the upload held config.json naming configuration_dream.py / modeling_dream.py (and the tokenizer's
    tokenization_dream.py) without the files. Now they are in output_dir, byte for byte, before the upload starts;
    the trainer keeps its tokenizer. The checkpoint has them too (the value trainer's saves did not carry the
    tokenizer's)."""
    model, tokenizer = dream_release_with_tokenizer(tmp_path)
    out = tmp_path / "out"
    trainer = make_trainer(name, model, tokenizer, out)
    push_checkpoint(trainer, out)
    [upload] = hub.uploads
    assert {p.name for p in (out / "checkpoint-1").glob("*.py")} == DREAM_CODE
    assert {p.name for p in upload.glob("*.py")} == DREAM_CODE
    for file_name in DREAM_CODE:
        assert (upload / file_name).read_bytes() == (tmp_path / "dream" / file_name).read_bytes()
    assert json.loads((upload / "tokenizer_config.json").read_text())["auto_map"] == {
        "AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]}
    assert trainer.processing_class is tokenizer


def test_hub_source_push_keeps_the_repository_references(tmp_path, hub, monkeypatch):
    """A model and tokenizer loaded from the Hub: the checkpoint's "repo--" references must reach the upload. Before,
    the tokenizer was re-saved into output_dir with its auto_map as loaded, naming a tokenization_dream.py the
    upload did not have."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = "Dream-org/Dream-v0-Instruct-7B"
    snapshot = hub_snapshot(tmp_path / "hub", repo)
    write_released("dream", snapshot, **DREAM_IDS)
    write_dream_tokenizer(snapshot)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(repo), AutoTokenizer.from_pretrained(repo)
    out = tmp_path / "out"
    push_checkpoint(make_trainer("sft", model, tokenizer, out), out)
    [upload] = hub.uploads
    assert json.loads((upload / "tokenizer_config.json").read_text())["auto_map"] == {
        "AutoTokenizer": [f"{repo}--tokenization_dream.DreamTokenizer", None]}
    assert json.loads((upload / "config.json").read_text())["auto_map"] == {
        key: f"{repo}--{ref}" for key, ref in RELEASED_EXTRAS["dream"]["auto_map"].items()}


@pytest.mark.slow
def test_pushed_training_checkpoint_loads_in_the_released_code(tmp_path, hub):
    """Through a real training step that saves and pushes (``save_steps=1``, ``hub_strategy="checkpoint"``, which
    also uploads the checkpoint folder): the repository's top level loads in the released code without
    trl_diffusion, model and tokenizer (~12 s: a fresh interpreter)."""
    model, tokenizer = dream_release_with_tokenizer(tmp_path)
    out = tmp_path / "out"
    trainer = make_trainer("sft", model, tokenizer, out, max_steps=1, save_strategy="steps", save_steps=1,
                           hub_strategy="checkpoint")
    trainer.train()
    top, checkpoint = hub.uploads[:2]
    assert DREAM_CODE <= {p.name for p in checkpoint.glob("*.py")}
    [entry] = load_without_trl_diffusion([top])
    assert entry["markers"] == ["released dream code"]
    assert entry["tokenizer_marker"] == "released dream tokenizer"


def test_missing_code_warning_is_said_once_with_the_fix(tmp_path):
    """A release without its .py files, saved twice (two checkpoints): one warning, naming the files and the call
    that copies them in. Before: the same warning on every save, without a fix."""
    write_released("sdar", tmp_path / "weights-only")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "weights-only")
    with CaptureLogger(logger) as captured:
        model.save_pretrained(tmp_path / "checkpoint-1")
        model.save_pretrained(tmp_path / "checkpoint-2")
    assert captured.out.count("configuration_sdar.py, modeling_sdar.py") == 1, captured.out
    fix = f"carry_remote_code({str(tmp_path / 'checkpoint-1')!r}, '<release folder>', 'config.json')"
    assert fix in captured.out, captured.out
    write_released("sdar", tmp_path / "other-weights-only")  # another source is warned about again
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "other-weights-only")
    with CaptureLogger(logger) as captured:
        model.save_pretrained(tmp_path / "checkpoint-3")
    assert captured.out.count("configuration_sdar.py, modeling_sdar.py") == 1, captured.out
