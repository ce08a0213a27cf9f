"""Combination audit of the model layer (families x dtypes x tying x save formats x loaders x PEFT x value model):
the combinations that were wrong."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_diffusion.testing import tiny_model

FAMILIES = ["sdar", "llada", "dream"]


@pytest.mark.parametrize("family", FAMILIES)
def test_output_attentions_is_refused_not_silently_none(family, tmp_path):
    """transformers passes ``attn_implementation="eager"`` through (it is accepted) and ``output_attentions=True`` was
    swallowed by ``**kwargs``: ``out.attentions`` came back None without a word. Attention runs in SDPA / flex kernels
    that never form the weights, so asking for them is an error; ``None`` / ``False`` (what peft passes) still work."""
    tiny_model(family).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    ids = torch.randint(5, 100, (1, 6))
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model(ids, output_attentions=True)
    for value in (None, False):
        assert model(ids, output_attentions=value).logits.shape == (1, 6, model.config.vocab_size)


@pytest.mark.parametrize("family", FAMILIES)
def test_return_dict_false_gives_a_tuple(family):
    """transformers' ``return_dict=False`` returns a tuple; ours returned the output object, whose unpacking gives its
    *keys*: ``loss, logits = model(ids, labels=ids, return_dict=False)`` bound the strings "loss" and "logits"."""
    model = tiny_model(family)
    ids = torch.randint(5, 100, (2, 7))
    expected = model(ids, labels=ids)
    out = model(ids, labels=ids, return_dict=False)
    assert isinstance(out, tuple)
    loss, logits = out[:2]
    assert torch.equal(loss, expected.loss) and torch.equal(logits, expected.logits)
    assert isinstance(model(ids, return_dict=True).logits, torch.Tensor)


def test_sdar_embedding_pad_row_gets_no_gradient_as_in_the_release():
    """The released SDAR modeling builds nn.Embedding(..., padding_idx=config.pad_token_id), as Dream's does: the
    pad row (here the EOS token, as SDAR's <|endoftext|>) gets no gradient. It used to train."""
    model = tiny_model("sdar")
    pad = model.config.pad_token_id
    assert pad is not None and model.model.embed_tokens.padding_idx == pad
    ids = torch.tensor([[5, 6, pad, 7, 8, pad, pad, 9]])
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    grad = model.model.embed_tokens.weight.grad
    assert grad[pad].abs().max() == 0 and grad[5].abs().max() > 0
    model.config.pad_token_id = None  # the released SDAR configs: no pad id, no padding_idx
    assert type(model.model)(model.config).embed_tokens.padding_idx is None


@pytest.mark.parametrize("family", FAMILIES)
def test_the_configs_output_switches_are_read(family, tmp_path):
    """transformers reads ``output_hidden_states`` / ``output_attentions`` from the config when the argument is None:
    ``from_pretrained(..., output_hidden_states=True)`` gave ``hidden_states=None``, and a config asking for the
    attention weights gave None instead of the error the argument gives."""
    from transformers import AutoModel

    tiny_model(family).save_pretrained(tmp_path)
    ids = torch.randint(5, 100, (1, 6))
    for loader in (AutoModelForCausalLM, AutoModel):
        model = loader.from_pretrained(tmp_path, output_hidden_states=True)
        hidden = model(ids).hidden_states
        assert hidden is not None and len(hidden) == model.config.num_hidden_layers + 1
        assert model(ids, output_hidden_states=False).hidden_states is None  # the argument wins
        eager = loader.from_pretrained(tmp_path, attn_implementation="eager", output_attentions=True)
        with pytest.raises(ValueError, match="output_attentions=True is not supported"):
            eager(ids)
    backbone = AutoModelForCausalLM.from_pretrained(tmp_path).model
    out = backbone(ids, return_dict=False)  # was the output object (its unpacking gives the keys)
    assert isinstance(out, tuple) and torch.equal(out[0], backbone(ids).last_hidden_state)


@pytest.mark.parametrize("family", FAMILIES)
def test_clear_errors_for_labels_with_kept_positions_and_for_transformers_caches(family):
    """Both raised deep inside: torch's "Expected input batch_size (6) to match target batch_size (24)" and
    "'DynamicCache' object has no attribute 'key_length'"."""
    from transformers import DynamicCache

    model = tiny_model(family)
    ids = torch.randint(5, 100, (2, 6))
    for keep in (3, torch.tensor([0, 2])):
        with pytest.raises(ValueError, match="labels need logits at every position"):
            model(ids, labels=ids, logits_to_keep=keep)
    with pytest.raises(ValueError, match="past_key_values must be a trl_diffusion DiffusionCache"):
        model(ids, past_key_values=DynamicCache())


def test_labels_refuse_every_logits_to_keep_but_all_positions():
    # a (rows, cols) pair of B positions on a model whose hidden size is L slipped through a shape check, and a
    # reordered 1-D selection gave a misaligned loss
    model = tiny_model("sdar")
    ids = torch.randint(5, 100, (2, 6))
    for keep in ((torch.tensor([0, 1]), torch.tensor([2, 3])), torch.tensor([5, 4, 3, 2, 1, 0]), 5):
        with pytest.raises(ValueError, match="labels need logits at every position"):
            model(ids, labels=ids, logits_to_keep=keep)
    full = model(ids, labels=ids).loss
    for keep in (0, None, 6, 10):
        assert torch.equal(model(ids, labels=ids, logits_to_keep=keep).loss, full)


def test_a_sliding_window_is_refused_only_where_a_layer_would_slide():
    # Qwen2/3: layers from max_window_layers up slide; with max_window_layers >= the layer count none does
    layers = tiny_model("sdar").config.num_hidden_layers
    model = tiny_model("sdar", use_sliding_window=True, sliding_window=8, max_window_layers=layers)
    assert model(torch.tensor([[5, 6, 7]])).logits.shape[1] == 3
    with pytest.raises(ValueError, match="use_sliding_window=True .*is not supported"):
        tiny_model("sdar", use_sliding_window=True, sliding_window=8, max_window_layers=layers - 1)


def test_a_sliding_window_on_a_config_without_max_window_layers_is_a_clear_error():
    # LLaDA-MoE's config has no max_window_layers: the refusal's message raised AttributeError
    from trl_diffusion.testing import tiny_moe_model

    with pytest.raises(ValueError, match="use_sliding_window=True with sliding_window=8 is not supported"):
        tiny_moe_model("llada_moe", use_sliding_window=True, sliding_window=8)
    with pytest.raises(ValueError, match="use_sliding_window=True"):
        tiny_model("sdar", use_sliding_window=True, sliding_window=8, max_window_layers=None)


@pytest.mark.parametrize("family", FAMILIES)
def test_writing_a_cache_under_gradient_checkpointing_is_a_clear_error(family):
    # the recompute in backward appended the keys again: "size of tensor a (16) must match ... (8)" or a
    # CheckpointError, raised from backward
    from trl_diffusion import DiffusionCache

    model = tiny_model(family).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(5, 100, (1, 8))
    with pytest.raises(ValueError, match="store_kv=True under gradient checkpointing"):
        model(ids, past_key_values=DiffusionCache(), store_kv=True)
    with torch.no_grad():  # writing without gradients is fine, and reading under checkpointing too
        cache = DiffusionCache()
        model(ids, past_key_values=cache, store_kv=True)
    model(torch.randint(5, 100, (1, 4)), past_key_values=cache).logits.sum().backward()
