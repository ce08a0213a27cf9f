"""Which attention kernel runs: ``resolve_attention_backend`` as a pure function of the device, the model's head
size and dtype and the torch version, the facts read from each family's model, the one warning of a fallback,
and an explicit ``"flex"`` that cannot run failing when the trainer is built."""

import logging

import pytest
import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM

from trl_diffusion import states
from trl_diffusion.assets import EMBEDDED_MODEL
from trl_diffusion.states import (
    AttentionFacts,
    attention_facts,
    flex_attention_problem,
    resolve_attention_backend,
    resolve_model_attention_backend,
)
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True)
def fresh_warnings():
    states._log_once.cache_clear()
    yield
    states._log_once.cache_clear()


@pytest.mark.parametrize(("device", "head_dim", "dtype", "version", "expected"), [
    ("cuda", 128, BF16, "2.11.0+cu130", "flex"),  # the released 4B / 8B models
    ("cuda", 64, FP16, "2.5.1", "flex"),
    ("cuda", 256, BF16, "2.13.0", "flex"),
    ("cuda", 32, FP32, "2.11.0", "sdpa"),  # the embedded model: failed to compile ("No choices to select")
    ("cuda", 128, FP32, "2.11.0", "sdpa"),  # float32 is not verified
    ("cuda", 32, BF16, "2.11.0", "sdpa"),  # small heads are not verified
    ("cuda", 96, BF16, "2.11.0", "sdpa"),  # nor other sizes
    ("cuda", 8, BF16, "2.11.0", "sdpa"),  # below the kernel's minimum
    ("cuda", 128, BF16, "2.4.1", "sdpa"),  # no flex attention with grouped-query heads yet
    ("cuda", None, None, "2.11.0", "sdpa"),  # facts unknown
    ("cpu", 128, BF16, "2.11.0", "sdpa"),  # flex is compiled only on CUDA (and has no CPU backward)
    ("mps", 128, BF16, "2.11.0", "sdpa"),
])
def test_auto_picks_flex_only_where_it_is_verified(device, head_dim, dtype, version, expected):
    assert resolve_attention_backend("auto", device, head_dim, dtype, torch_version=version) == expected
    assert resolve_attention_backend("sdpa", device, head_dim, dtype, torch_version=version) == "sdpa"


@pytest.mark.parametrize(("device", "head_dim", "version", "training", "match"), [
    ("cuda", 8, "2.11.0", True, "head_dim >= 16"),
    ("cuda", 128, "2.4.1", True, "torch 2.4.1"),
    ("cpu", 128, "2.11.0", True, "no CPU backward"),
])
def test_explicit_flex_that_cannot_run_is_an_error_saying_why(device, head_dim, version, training, match):
    with pytest.raises(ValueError, match=match):
        resolve_attention_backend("flex", device, head_dim, BF16, training=training, torch_version=version)


def test_explicit_flex_that_is_only_unverified_runs_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="trl_diffusion.states"):
        for _ in range(3):
            assert resolve_attention_backend("flex", "cuda", 32, FP32, torch_version="2.11.0") == "flex"
    assert len(caplog.records) == 1 and "not verified" in caplog.text and "head_dim 32" in caplog.text
    assert resolve_attention_backend("flex", "cpu", 32, FP32, training=False) == "flex"  # eager, forward only


def test_auto_fallback_on_cuda_says_why_once(caplog):
    with caplog.at_level(logging.WARNING, logger="trl_diffusion.states"):
        for _ in range(3):
            resolve_attention_backend("auto", "cuda", 32, FP32, torch_version="2.11.0")
        resolve_attention_backend("auto", "cpu", 32, FP32)  # the normal CPU choice: nothing to say
    assert len(caplog.records) == 1
    assert "runs SDPA, not flex attention" in caplog.text and "head_dim 32 in float32" in caplog.text


def test_the_problem_is_fatal_only_when_flex_cannot_run():
    assert flex_attention_problem(AttentionFacts("cuda", 128, BF16), "2.11.0") == (None, False)
    assert flex_attention_problem(AttentionFacts("cuda", 8, BF16), "2.11.0")[1]
    assert flex_attention_problem(AttentionFacts("cuda", 128, BF16), "2.4.0")[1]
    assert not flex_attention_problem(AttentionFacts("cuda", 32, FP32), "2.11.0")[1]
    assert not flex_attention_problem(AttentionFacts("cpu", 128, BF16), "2.11.0")[1]


def test_facts_come_from_each_family_and_the_embedded_model_trains_on_cuda_with_sdpa():
    for family in ("sdar", "llada", "dream"):
        facts = attention_facts(tiny_model(family))
        assert facts == AttentionFacts("cpu", 16, FP32), family
    big_heads = tiny_model("sdar", head_dim=128).to(BF16)
    assert attention_facts(big_heads, "cuda") == AttentionFacts("cuda", 128, BF16)
    assert resolve_model_attention_backend("auto", big_heads, "cuda") == "flex"
    config = AutoConfig.from_pretrained(EMBEDDED_MODEL)
    embedded = AutoModelForCausalLM.from_config(config)
    assert attention_facts(embedded, "cuda") == AttentionFacts("cuda", 32, FP32)
    assert resolve_model_attention_backend("auto", embedded, "cuda") == "sdpa"
    with pytest.raises(ValueError, match="head_dim >= 16"):
        resolve_model_attention_backend("flex", tiny_model("sdar", head_dim=8), "cuda")


def test_sft_trainer_fails_at_construction_when_flex_cannot_run(tmp_path, monkeypatch):
    data = Dataset.from_list([{"prompt": "What is 1+1?\n", "completion": "\\boxed{2}"}])

    def build(backend):
        args = DiffusionSFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False, use_cpu=True, max_length=32,
                                  attention_backend=backend)
        return DiffusionSFTTrainer(tiny_model("sdar"), args=args, train_dataset=data,
                                   processing_class=build_tokenizer())

    assert build("auto").attention_backend == "sdpa"
    assert build("flex").attention_backend == "flex"  # CPU: allowed for no-grad evaluation, refused in a backward
    monkeypatch.setattr(torch, "__version__", "2.4.1")
    with pytest.raises(ValueError, match="torch 2.4.1"):
        build("flex")
