"""Keyword arguments and ``config=`` when loading a ``DiffusionValueModel``, and policies it cannot be built from.

Before: ``DiffusionValueModel.from_pretrained(value_dir, block_size=8)`` (or ``.load``) was a TypeError from
``__init__`` (the config was built from the hub keywords only and passed as an object, so config keywords reached the
model); ``config=<path>`` warned about a model of type ``""`` and failed with an AttributeError (``config_class`` was
the bare ``PretrainedConfig``); ``config=<object>`` plus a config keyword told a policy user that the config "does
not have" an attribute it has; and a policy with disk-offloaded weights failed deep in torch ("Cannot copy out of
meta tensor")."""

from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from trl_diffusion.testing import tiny_model
from trl_diffusion.value import DiffusionValueModel

QWEN_STYLE_OFFLOADED = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                        "model.norm": "cpu", "lm_head": "cpu"}
OFFLOADED = {
    "sdar": QWEN_STYLE_OFFLOADED,
    "dream": QWEN_STYLE_OFFLOADED,
    "llada": {"model.transformer.wte": "cpu", "model.transformer.emb_drop": "cpu", "model.transformer.blocks.0": "cpu",
              "model.transformer.blocks.1": "disk", "model.transformer.ln_f": "cpu",
              "model.transformer.ff_out": "cpu"},
}
"""A ``device_map`` per family that puts the tiny policy's second layer on disk (the rest on CPU)."""


def saved(tmp_path: Path, family: str) -> tuple[Path, Path]:
    """``(policy_dir, value_dir)``: a tiny policy of ``family`` and a value model copied from it, both saved."""
    policy = tiny_model(family)
    policy.save_pretrained(tmp_path / "policy")
    DiffusionValueModel.from_policy(policy).save_pretrained(tmp_path / "value")
    return tmp_path / "policy", tmp_path / "value"


@pytest.mark.parametrize("loader", [DiffusionValueModel.from_pretrained, DiffusionValueModel.load])
def test_a_config_keyword_updates_a_saved_value_models_config(tmp_path, loader):
    _, value_dir = saved(tmp_path, "sdar")
    value = loader(value_dir, block_size=8, output_hidden_states=True)
    assert value.block_size == 8 and value.config.block_size == 8 and value.config.output_hidden_states
    with pytest.raises(ValueError, match="block_size must be a positive integer"):  # checked as for the policy
        loader(value_dir, block_size=0)


@pytest.mark.parametrize("loader", [DiffusionValueModel.from_pretrained, DiffusionValueModel.load])
def test_a_keyword_that_is_no_config_attribute_is_named(tmp_path, family, loader):
    _, value_dir = saved(tmp_path, family)
    with pytest.raises(ValueError, match=r"DiffusionValueModel got arguments its config does not have: \['foo'\]"):
        loader(value_dir, foo=1)


def test_config_may_be_a_path(tmp_path):
    _, value_dir = saved(tmp_path, "sdar")
    assert isinstance(DiffusionValueModel.from_pretrained(value_dir, config=str(value_dir)), DiffusionValueModel)
    config = AutoConfig.from_pretrained(value_dir)
    config.block_size = 8
    config.save_pretrained(tmp_path / "edited")
    assert DiffusionValueModel.from_pretrained(value_dir, config=tmp_path / "edited").block_size == 8
    assert DiffusionValueModel.from_pretrained(value_dir, config=config).block_size == 8  # an object, as before


def test_config_object_plus_a_config_keyword_says_to_set_it_on_the_object(tmp_path):
    policy_dir, value_dir = saved(tmp_path, "sdar")
    remedy = r"config= passed as an object.*config\.block_size = 8"
    with pytest.raises(ValueError, match=remedy):
        AutoModelForCausalLM.from_pretrained(policy_dir, config=AutoConfig.from_pretrained(policy_dir), block_size=8)
    with pytest.raises(ValueError, match=remedy):
        DiffusionValueModel.from_pretrained(value_dir, config=AutoConfig.from_pretrained(value_dir), block_size=8)
    with pytest.raises(ValueError, match=r"does not have: \['foo'\]\.$"):  # an unknown name keeps its message
        AutoModelForCausalLM.from_pretrained(policy_dir, config=AutoConfig.from_pretrained(policy_dir), foo=1)


@pytest.mark.parametrize("loader", [DiffusionValueModel.from_policy, DiffusionValueModel.load])
def test_an_offloaded_policy_is_refused_before_copying(tmp_path, family, loader):
    policy_dir, _ = saved(tmp_path, family)
    with pytest.raises(ValueError, match=r"offloaded \(meta / disk\) policy weights is not supported.*fully on CPU"):
        loader(str(policy_dir), device_map=OFFLOADED[family], offload_folder=str(tmp_path / "offload"))



def test_llada_policy_names_unknown_and_config_keywords(tmp_path):
    """LLaDA's policy class names the keywords as SDAR / Dream do (it was a bare TypeError from ``__init__``)."""
    policy_dir, _ = saved(tmp_path, "llada")
    with pytest.raises(ValueError, match=r"LLaDAModelLM got arguments its config does not have: \['foo'\]"):
        AutoModelForCausalLM.from_pretrained(policy_dir, foo=1)
    with pytest.raises(ValueError, match=r"config= passed as an object.*config\.output_hidden_states = True"):
        AutoModelForCausalLM.from_pretrained(policy_dir, config=AutoConfig.from_pretrained(policy_dir),
                                             output_hidden_states=True)
