"""The embedded model the examples default to: it loads with the Auto classes and scores on its own held-out task
what its results.json records."""

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_diffusion.assets import EMBEDDED_CHAT_TEMPLATE, EMBEDDED_FORMAT, EMBEDDED_MODEL, EMBEDDED_TASK
from trl_diffusion.data import evaluate_accuracy, make_problems

RESULTS = json.loads((EMBEDDED_MODEL / "results.json").read_text())
BAND = 0.02
"""Greedy decoding of this small trained model has near-ties among almost-certain positions (probabilities 1 - 1e-7
apart), which another CPU's kernels may order differently: up to 10 of the 500 answers may move."""


def test_embedded_model_scores_its_recorded_accuracy_on_its_task():
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    assert type(model).__name__ == "SDARForCausalLM" and model.block_size == 4
    assert sum(p.numel() for p in model.parameters()) == RESULTS["num_parameters"]
    assert tokenizer.mask_token_id == model.mask_token_id
    assert RESULTS["dataset_format"] == EMBEDDED_FORMAT
    assert (RESULTS["digits"], RESULTS["num_test"], RESULTS["seed"]) == (
        EMBEDDED_TASK["digits"], EMBEDDED_TASK["num_test"], EMBEDDED_TASK["seed"])
    _, held_out = make_problems(**EMBEDDED_TASK)
    accuracy = evaluate_accuracy(model, tokenizer, held_out, chat_template=EMBEDDED_CHAT_TEMPLATE)
    assert accuracy == pytest.approx(RESULTS["accuracy"], abs=BAND)


def test_every_embedding_row_of_the_embedded_model_trains():
    """The model was trained with every embedding row trainable, as SDAR's releases (no pad id in their configs);
    its config named pad id 0 (its EOS), so loading it gave the embedding ``padding_idx=0`` and further training
    never moved the EOS row. ``train_arithmetic.py`` builds its models the same way."""
    import importlib.util
    import sys
    from pathlib import Path

    import torch

    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL)
    assert model.get_input_embeddings().padding_idx is None and model.generation_config.pad_token_id == 0
    model.get_input_embeddings().weight.grad = None
    model(input_ids=torch.tensor([[0, 5, 0]])).logits.sum().backward()
    assert model.get_input_embeddings().weight.grad[0].abs().sum() > 0
    path = Path(__file__).resolve().parent.parent / "scripts" / "train_arithmetic.py"
    spec = importlib.util.spec_from_file_location("train_arithmetic_script", path)
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # its dataclasses look their module up
    spec.loader.exec_module(script)
    fresh = script.build_model("sdar", 32, 1, 0)
    assert fresh.get_input_embeddings().padding_idx is None
