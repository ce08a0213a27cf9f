"""RoPE settings of every family's config. transformers 5 configs keep the base only in ``rope_parameters``
(``{"rope_type": "default", "rope_theta": ...}``, no top-level ``rope_theta``: ``Qwen3Config(...).to_dict()``, a
``config.json`` that transformers 5 saved); our configs ignored that key, so such a config silently ran at
rope_theta=10000. A scaled ``rope_parameters`` bypassed the refusal of ``rope_scaling`` (the model ran unscaled),
LLaDA accepted and ignored ``rope_scaling`` (``from_pretrained(..., rope_scaling=...)`` was a TypeError), and
``rope_scaling={"rope_type": "default"}``, which is no scaling, was refused."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen3Config

import trl_diffusion  # noqa: F401  (registers the families)
from trl_diffusion.models import DreamConfig, SDARConfig
from trl_diffusion.testing import (
    tiny_dream_config,
    tiny_llada_config,
    tiny_llada_moe_config,
    tiny_model,
    tiny_moe_model,
    tiny_sdar_config,
    tiny_sdar_moe_config,
)

CONFIGS = {"sdar": tiny_sdar_config, "sdar_moe": tiny_sdar_moe_config, "llada": tiny_llada_config,
           "llada_moe": tiny_llada_moe_config, "dream": tiny_dream_config}
FAMILIES = list(CONFIGS)
SCALED = [{"rope_type": "linear", "factor": 4.0}, {"type": "dynamic", "factor": 2.0},
          {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
          {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 128}]
IDS = torch.tensor([[5, 17, 33, 8, 91, 40, 12, 77, 3, 64]])


def build(family: str, **overrides):
    return (tiny_model if family in ("sdar", "llada", "dream") else tiny_moe_model)(family, **overrides).eval()


def without_theta(family: str, **rope) -> dict:
    """The tiny config's dict as transformers 5 writes it: no top-level rope_theta, the given rope keys instead."""
    config = CONFIGS[family]().to_dict()
    config.pop("rope_theta")
    return {**config, **rope}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each family saved with rope_theta=1e6, and its logits on IDS."""
    root = tmp_path_factory.mktemp("rope")
    saved = {}
    for family in FAMILIES:
        model = build(family, rope_theta=1e6)
        model.save_pretrained(root / family)
        with torch.no_grad():
            saved[family] = (root / family, model(IDS).logits)
    return saved


def rewrite_config(folder, tmp_path, edit):
    """A copy of ``folder`` whose config.json went through ``edit`` (the weights are linked, not copied)."""
    for file in folder.iterdir():
        if file.name != "config.json":
            (tmp_path / file.name).symlink_to(file)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


# ------------------------------------------------------------------------------------- rope_theta from rope_parameters


def test_sdar_and_dream_configs_from_transformers5_qwen_configs():
    """How SDAR was made (Qwen3 + block diffusion), and Dream (Qwen2): the Qwen config's dict carries its base in
    rope_parameters only."""
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=1e6)
    qwen3 = {k: v for k, v in Qwen3Config(head_dim=16, **sizes).to_dict().items() if k != "model_type"}
    assert "rope_theta" not in qwen3 and qwen3["rope_parameters"]["rope_theta"] == 1e6
    assert SDARConfig(**qwen3, block_size=4, mask_token_id=5).rope_theta == 1e6  # was 10000.0
    qwen2 = {k: v for k, v in Qwen2Config(**sizes).to_dict().items() if k != "model_type"}
    assert DreamConfig(**qwen2).rope_theta == 1e6


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_theta_from_rope_parameters(family):
    config_class = type(CONFIGS[family]())
    config = config_class(**without_theta(family, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert config.rope_theta == 1e6  # was 10000.0 (LLaDA-MoE: "rope_theta not set")
    assert config_class(**without_theta(family, rope_scaling={"rope_theta": 5e5})).rope_theta == 5e5
    # the same base given twice is fine; two different ones are an error naming both
    assert config_class(**without_theta(family, rope_theta=1e6, rope_parameters={"rope_theta": 1e6})).rope_theta == 1e6
    with pytest.raises(ValueError, match=r"rope_theta=10000.0 and rope_parameters\['rope_theta'\]=1000000.0 differ"):
        config_class(**without_theta(family, rope_theta=1e4, rope_parameters={"rope_theta": 1e6}))
    with pytest.raises(ValueError, match=r"rope_parameters\['rope_theta'\] must be a positive number"):
        config_class(**without_theta(family, rope_parameters={"rope_type": "default", "rope_theta": "1e6"}))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformers5_config_json_loads_its_rope_theta(family, folders, tmp_path):
    """A config.json with rope_parameters and no rope_theta (what transformers 5 saves) loads the model it describes:
    the logits of the rope_theta=1e6 model (2 to 6 apart before)."""
    folder, logits = folders[family]

    def edit(config):
        config.pop("rope_theta")
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}

    edited = rewrite_config(folder, tmp_path, edit)
    assert AutoConfig.from_pretrained(edited).rope_theta == 1e6
    model = AutoModelForCausalLM.from_pretrained(edited).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_parameters_keyword_sets_rope_theta(family, folders):
    folder, _ = folders[family]
    config = AutoConfig.from_pretrained(folder, rope_parameters={"rope_type": "default", "rope_theta": 2e6})
    assert config.rope_theta == 2e6
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 2e6} and config.rope_scaling is None


# ------------------------------------------------------------------------------------------------- scaling refused


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("scaling", SCALED, ids=lambda s: s.get("rope_type", s.get("type")))
def test_scaled_rope_is_refused_under_either_key(family, key, scaling):
    """rope_parameters with a scaling type was accepted and ignored (the model ran unscaled), rope_scaling too on
    LLaDA."""
    with pytest.raises(ValueError, match=rf"rope_scaling is not supported .*{key}="):
        CONFIGS[family](**{key: dict(scaling)})


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rope", [{"rope_type": "default", "factor": 2.0}, {"partial_rotary_factor": 0.5},
                                  {"rope_type": "default", "mrope_section": [2, 2, 4]}])
def test_keys_that_would_change_unscaled_rope_are_refused(family, rope):
    with pytest.raises(ValueError, match=r"rope_scaling is not supported .*rope_parameters=.*does not take"):
        CONFIGS[family](rope_parameters=rope)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_scaled_config_json_or_keyword_is_refused(family, folders, tmp_path):
    folder, _ = folders[family]
    edited = rewrite_config(folder, tmp_path, lambda config: config.update(
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}))
    with pytest.raises(ValueError, match="rope_scaling is not supported .*rope_parameters="):
        AutoModelForCausalLM.from_pretrained(edited)  # was loaded, unscaled
    # the keyword path: LLaDA's was "LLaDAModelLM.__init__() got an unexpected keyword argument 'rope_scaling'"
    for key in ("rope_scaling", "rope_parameters"):
        with pytest.raises(ValueError, match=f"rope_scaling is not supported .*{key}="):
            AutoModelForCausalLM.from_pretrained(folder, **{key: {"rope_type": "linear", "factor": 2.0}})


# --------------------------------------------------------------------------------- "default" is no scaling


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rope", [{"rope_type": "default"}, {"type": "default"}, {}, None])
def test_default_rope_type_is_no_scaling(family, rope):
    """Was refused (as rope_scaling) on every family but LLaDA, where it was kept and saved as rope_parameters."""
    for key in ("rope_scaling", "rope_parameters"):
        config = CONFIGS[family](rope_theta=5e5, **{key: rope})
        assert config.rope_theta == 5e5 and config.rope_scaling is None
        saved = config.to_dict()
        assert saved["rope_theta"] == 5e5 and "rope_scaling" not in saved and "rope_parameters" not in saved


@pytest.mark.parametrize("family", FAMILIES)
def test_released_rope_scaling_null_and_default_keyword_load(family, folders, tmp_path):
    folder, logits = folders[family]
    edited = rewrite_config(folder, tmp_path, lambda config: config.update(rope_scaling=None))  # as released
    for model in (AutoModelForCausalLM.from_pretrained(edited),
                  AutoModelForCausalLM.from_pretrained(folder, rope_scaling={"rope_type": "default"})):
        assert model.config.rope_theta == 1e6
        with torch.no_grad():
            torch.testing.assert_close(model.eval()(IDS).logits, logits, rtol=0, atol=0)


# -------------------------------------------------------------------------------------- round trips, released layout


@pytest.mark.parametrize("family", FAMILIES)
def test_configs_round_trip_in_the_released_layout(family, folders, tmp_path):
    """The saved config.json keeps the released layout (top-level rope_theta, which the released modeling code
    reads, no rope_parameters), and loads back to the same config; an unset base is the release's default."""
    folder, _ = folders[family]
    saved = json.loads((folder / "config.json").read_text())
    assert saved["rope_theta"] == 1e6 and "rope_parameters" not in saved and "rope_scaling" not in saved
    config = AutoConfig.from_pretrained(folder)
    assert type(config).from_dict(config.to_dict()).to_dict() == config.to_dict()
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rope_theta"] == 1e6
    reloaded = AutoConfig.from_pretrained(tmp_path).to_dict()
    assert {**reloaded, "_name_or_path": None} == {**config.to_dict(), "_name_or_path": None}
    default = type(config)()
    assert default.rope_theta == (None if family == "llada_moe" else 10000.0)
    assert default.rope_parameters == {"rope_type": "default", "rope_theta": default.rope_theta}


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_released_llada_layout_without_rope_keys_loads(family):
    """The released LLaDA config.json has rope_theta and no rope_scaling / rope_parameters; SDAR's and Dream's have
    rope_scaling null: a dict without either rope key still gives its rope_theta."""
    config = CONFIGS[family]().to_dict()
    config["rope_theta"] = 500000.0
    assert type(CONFIGS[family]()).from_dict(config).rope_theta == 500000.0
