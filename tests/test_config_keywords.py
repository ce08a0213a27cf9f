"""Config values given to ``from_pretrained`` as keyword arguments, or set on a built model's config, get the
checks the config's constructor makes: transformers sets those keywords after the constructor ran, and an edit
skips it too. ``block_size=None`` made an SDAR model a full-attention one, silently, and the folder it saved could
not be loaded; SDAR-MoE's ``num_experts_per_tok=0`` zeroed every expert block."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import trl_diffusion  # noqa: F401  (registers the families)
from trl_diffusion.testing import tiny_model, tiny_moe_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    paths = {}
    for family, model in (("sdar", tiny_model("sdar")), ("dream", tiny_model("dream")),
                          ("sdar_moe", tiny_moe_model("sdar_moe"))):
        model.save_pretrained(root / family)
        paths[family] = str(root / family)
    return paths


@pytest.mark.parametrize("value", [None, 0, -1, 2.0, "8", True])
def test_a_block_size_keyword_is_checked(folders, value):
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        AutoModelForCausalLM.from_pretrained(folders["sdar"], block_size=value)
    model = AutoModelForCausalLM.from_pretrained(folders["sdar"], block_size=8)  # a valid one is honoured
    assert model.block_size == 8 and model.model.diffusion_block_size == 8


@pytest.mark.parametrize("value", [None, 0])
def test_a_block_size_edited_on_a_built_model_is_checked_where_it_is_read(folders, value):
    model = AutoModelForCausalLM.from_pretrained(folders["sdar"])
    model.config.block_size = value
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        model(torch.tensor([[5, 6, 7]]))
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        _ = model.attention_kind  # was "full"


@pytest.mark.parametrize("value", [0, 9])
def test_sdar_moe_top_k_keyword_is_checked(folders, value):
    with pytest.raises(ValueError, match="num_experts_per_tok must be an integer in"):
        AutoModelForCausalLM.from_pretrained(folders["sdar_moe"], num_experts_per_tok=value)


def test_refused_fields_as_keywords_are_refused(folders):
    with pytest.raises(ValueError, match="attention_bias=True is not supported"):  # was loaded and ignored
        AutoModelForCausalLM.from_pretrained(folders["sdar"], attention_bias=True)
    for family in ("sdar", "dream"):  # was "__init__() got an unexpected keyword argument 'rope_scaling'"
        with pytest.raises(ValueError, match="rope_scaling is not supported"):
            AutoModelForCausalLM.from_pretrained(folders[family], rope_scaling={"rope_type": "linear", "factor": 2.0})
    for family in ("sdar", "sdar_moe", "dream"):  # was built with full attention, the window silently ignored
        with pytest.raises(ValueError, match="use_sliding_window=True .*is not supported"):
            AutoModelForCausalLM.from_pretrained(folders[family], use_sliding_window=True, sliding_window=8,
                                                 max_window_layers=0)
