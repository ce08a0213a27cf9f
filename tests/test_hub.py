"""Hub push: TRL's plumbing writes the model card (method, TraceRL citation) and a checkpoint that loads with
AutoModelForCausalLM after `import trl_diffusion`. The upload goes to a local directory (no network)."""

import shutil
import subprocess
import sys
from types import SimpleNamespace

import transformers.trainer
from datasets import Dataset

from trl_diffusion import TraceRLConfig, TraceRLTrainer
from trl_diffusion.testing import build_tokenizer, tiny_model


class LocalHub:
    """Stands in for huggingface_hub.HfApi: repositories are folders under ``root``."""

    def __init__(self, root):
        self.root = root

    def create_repo(self, repo_id, **kwargs):
        (self.root / repo_id).mkdir(parents=True, exist_ok=True)
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, repo_id, folder_path, ignore_patterns=(), **kwargs):
        shutil.copytree(folder_path, self.root / repo_id, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(*ignore_patterns))
        return SimpleNamespace(commit_url=str(self.root / repo_id))


def test_push_to_hub_writes_card_and_loadable_checkpoint(tmp_path, monkeypatch):
    hub = LocalHub(tmp_path / "hub")
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    args = TraceRLConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                         max_completion_length=8, max_steps=1, report_to="none", use_cpu=True, bf16=False,
                         gradient_checkpointing=False, save_strategy="no", hub_model_id="me/tiny-tracerl",
                         disable_tqdm=True, dynamic_group_filtering="none")  # length rewards lie beyond [0, 1]
    dataset = Dataset.from_dict({"prompt": ["What is 1+2?", "abc"] * 2})
    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    trainer = TraceRLTrainer(tiny_model("sdar").train(), length, args=args, train_dataset=dataset,
                             processing_class=build_tokenizer())
    trainer.train()
    trainer.push_to_hub()
    repo = tmp_path / "hub" / "me" / "tiny-tracerl"
    card = (repo / "README.md").read_text()
    assert "TraceRL" in card and "2509.06949" in card and "trl_diffusion" in card
    code = (
        "import sys, torch, trl_diffusion\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); t = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "ids = t(['What is 1+2?'], return_tensors='pt')['input_ids']\n"
        "out = m.generate(ids, max_new_tokens=8, block_length=4, denoising_steps=4, temperature=0.0)\n"
        "assert out.shape[1] >= ids.shape[1] + 8 and type(m).__name__ == 'SDARForCausalLM'\n"
    )
    subprocess.run([sys.executable, "-c", code, str(repo)], check=True)


def test_a_card_does_not_publish_a_local_dataset_path(tmp_path):
    # the examples push with dataset_name=<their --dataset_name>: a local file went into the card's metadata and a
    # huggingface.co/datasets/<absolute path> link
    from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer
    from trl_diffusion.model_card import card_dataset_name

    local = tmp_path / "train.jsonl"
    local.write_text('{"prompt": "1+2=", "completion": "3"}\n')
    args = DiffusionSFTConfig(str(tmp_path / "out"), report_to="none", use_cpu=True, bf16=False, save_strategy="no")
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=args, processing_class=build_tokenizer(),
                                  train_dataset=Dataset.from_dict({"prompt": ["1+2="], "completion": ["3"]}))
    trainer.create_model_card(dataset_name=str(local))
    assert "datasets" not in (tmp_path / "out" / "README.md").read_text()
    trainer.create_model_card(dataset_name="openai/gsm8k")
    assert "openai/gsm8k" in (tmp_path / "out" / "README.md").read_text()
    assert card_dataset_name("/data/train.jsonl") is None and card_dataset_name("~/train.jsonl") is None
