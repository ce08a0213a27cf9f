"""Training attention masks: the layout rule against an element-by-element definition, the flex-attention
``BlockMask`` against the dense SDPA mask, and the flex path against the SDPA path for SFT losses, packed
trajectory scoring, value scoring and the trainer's config switch. On CPU torch runs flex attention eagerly and
forward only, so these compare forwards (under no_grad); the backward is torch's kernel."""

import pytest
import torch
from datasets import Dataset
from numerics import assert_close_fp32

from trl_diffusion.estimators import EstimatorSettings, estimate_logprobs
from trl_diffusion.models import LLaDAModelLM
from trl_diffusion.models.cache import DiffusionCache
from trl_diffusion.states import (
    CLEAN,
    AttentionLayout,
    block_index,
    noisy_clean_attention_layout,
    noisy_columns,
    positions_from_padding,
    resolve_attention_backend,
)
from trl_diffusion.testing import EOS_ID, MASK_ID, build_tokenizer, tiny_llada_config, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer, TraceRLConfig
from trl_diffusion.trainers.diffusion_losses import (
    build_objective,
    count_loss_tokens,
    diffusion_loss,
    sample_generators,
)
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel
from trl_diffusion.value.value_model import token_values

TOKENIZER = build_tokenizer()


def padded_rows():
    """Two right-padded rows: prompt tokens then a completion, labels -100 on prompt and padding."""
    rows = [([20, 21, 22, 23, 24], [30, 31, 32, 33, 34, 35, EOS_ID]), ([40, 41], [50, 51, 52, EOS_ID])]
    width = max(len(p) + len(c) for p, c in rows) + 2
    ids = torch.full((2, width), EOS_ID)
    labels = torch.full((2, width), -100)
    valid = torch.zeros((2, width), dtype=torch.bool)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
        valid[i, : len(p) + len(c)] = True
    return ids, labels, valid


def test_noisy_clean_layout_matches_the_element_by_element_definition():
    """[x_t | x_0]: a noisy token sees the noisy tokens of its block and the clean tokens of earlier blocks; a
    clean token sees clean tokens of its own and earlier blocks; padding keys are hidden."""
    _, _, valid = padded_rows()
    positions = positions_from_padding(valid)
    block_size, start = 4, 4
    cols = torch.arange(valid.shape[1]).expand_as(valid)
    dense = noisy_clean_attention_layout(positions, valid, block_size, noisy_columns(cols >= start)).dense()[:, 0]
    blocks = block_index(positions, block_size)
    length, n_noisy = valid.shape[1], valid.shape[1] - start
    for b in range(2):
        for q in range(n_noisy + length):
            q_noisy = q < n_noisy
            q_col = q + start if q_noisy else q - n_noisy
            if not valid[b, q_col]:
                assert dense[b, q].all()  # padding queries: opened, never read
                continue
            for k in range(n_noisy + length):
                k_noisy = k < n_noisy
                k_col = k + start if k_noisy else k - n_noisy
                if q_noisy and k_noisy:
                    expected = blocks[b, k_col] == blocks[b, q_col]
                elif q_noisy:
                    expected = blocks[b, k_col] < blocks[b, q_col]
                elif k_noisy:
                    expected = False
                else:
                    expected = blocks[b, k_col] <= blocks[b, q_col]
                assert bool(dense[b, q, k]) == bool(expected and valid[b, k_col]), (b, q, k)


def test_plain_layout_is_block_causal_or_full():
    positions = torch.arange(8)[None]
    valid = torch.ones(1, 8, dtype=torch.bool)
    causal = AttentionLayout.plain(positions, valid, 4).dense()[0, 0]
    assert torch.equal(causal, block_index(positions[0], 4)[None, :] <= block_index(positions[0], 4)[:, None])
    assert AttentionLayout.plain(positions, valid, None).dense().all()
    assert (AttentionLayout.plain(positions, valid, None).copy == CLEAN).all()


def flex_mask_as_dense(layout):
    """The element mask the BlockMask's mask_mod defines, materialised."""
    from torch.nn.attention.flex_attention import create_mask

    block_mask = layout.attention_mask("flex")
    batch, length = layout.block.shape
    return create_mask(block_mask.mask_mod, batch, 1, length, length, device="cpu")


@pytest.mark.parametrize("block_size", [None, 4])
def test_block_mask_defines_the_dense_mask_on_every_real_query(block_size):
    _, _, valid = padded_rows()
    positions = positions_from_padding(valid)
    layouts = [AttentionLayout.plain(positions, valid, block_size)]
    if block_size is not None:
        cols = torch.arange(valid.shape[1]).expand_as(valid)
        layouts.append(noisy_clean_attention_layout(positions, valid, block_size, noisy_columns(cols >= 4)))
    with torch.no_grad():
        for layout in layouts:
            dense, flex = layout.dense()[:, 0], flex_mask_as_dense(layout)[:, 0]
            real = layout.valid
            assert torch.equal(flex[real], dense[real])
            assert not flex[~real].any()  # padding queries see nothing under flex (zeros out, never read)


@pytest.mark.parametrize(("family", "objective"), [("sdar", "block"), ("sdar", "complementary"),
                                                   ("llada", "random_masking"), ("dream", "random_masking"),
                                                   ("llada", "semi_ar")])
def test_flex_equals_sdpa_for_sft_losses(family, objective):
    model = tiny_model(family)
    ids, labels, valid = padded_rows()
    losses = []
    for backend in ("sdpa", "flex"):
        batch = build_objective(objective, ids, labels, valid, sample_generators([0, 1], 0, 0), mask_token_id=MASK_ID,
                                block_size=model.block_size, semi_ar_block_length=4)
        assert batch.layout is not None
        normaliser = count_loss_tokens(labels, model.logits_shift)
        with torch.no_grad():
            loss, _ = diffusion_loss(model, batch, normaliser, model.logits_shift, MASK_ID, attention_backend=backend)
        losses.append(loss)
    assert losses[0] > 0
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)


def rollout(model):
    prompts = [[20, 21, 22, 23, 24, 25, 26], [30, 31, 32]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, mask, max_new_tokens=8, block_length=4, denoising_steps=2, temperature=1.0,
                         stop_token_ids=[], return_dict_in_generate=True, generator=torch.Generator().manual_seed(0))
    return ids, mask, out.sequences[:, width:], out.unmask_step[:, width:], out.token_logprobs[:, width:]


@pytest.mark.parametrize("estimator", ["trajectory", "coupled"])
def test_flex_equals_sdpa_for_packed_scoring(family, estimator):
    """Packed trajectory scoring (copies of blocks, chunked) gives the same log-probs through either backend,
    and through flex still equals the sampler's own log-probs (trajectory, shrinkage 1)."""
    model = tiny_model(family)
    ids, mask, completion, steps, sampler = rollout(model)
    seeds = torch.tensor([3, 4])
    out = {}
    for backend in ("sdpa", "flex"):
        settings = EstimatorSettings(name=estimator, block_size=4, token_budget=64, attention_backend=backend)
        with torch.no_grad():
            out[backend], _, scored = estimate_logprobs(model, ids, mask, completion, steps, settings, seeds)
    torch.testing.assert_close(out["sdpa"], out["flex"], atol=1e-5, rtol=1e-5)
    if estimator == "trajectory":
        assert_close_fp32(out["flex"], sampler, scored)


def test_flex_equals_sdpa_for_value_scoring():
    policy = tiny_model("sdar")
    value = DiffusionValueModel.from_policy(policy)
    with torch.no_grad():  # a non-zero head: from_policy's zero head gives 0 through either backend
        value.value_head.weight.copy_(torch.randn(value.value_head.weight.shape,
                                                  generator=torch.Generator().manual_seed(0)))
    ids, mask, completion, steps, _ = rollout(policy)
    with torch.no_grad():
        sdpa, _ = token_values(value, ids, mask, completion, steps, attention_backend="sdpa")
        flex, _ = token_values(value, ids, mask, completion, steps, attention_backend="flex")
    assert sdpa[steps >= 0].abs().min() > 0
    assert_close_fp32(flex, sdpa, steps >= 0)


def test_backend_choice_and_errors():
    assert resolve_attention_backend("auto", torch.device("cpu")) == "sdpa"
    assert resolve_attention_backend("auto", torch.device("cuda"), 128, torch.bfloat16) == "flex"
    assert resolve_attention_backend("auto", torch.device("cuda")) == "sdpa"  # facts unknown
    with torch.no_grad():
        assert resolve_attention_backend("flex", torch.device("cpu")) == "flex"
    with pytest.raises(ValueError, match="no CPU backward"):
        resolve_attention_backend("flex", torch.device("cpu"))  # training on CPU
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_attention_backend("xformers", torch.device("cpu"))
    for config_cls in (DiffusionSFTConfig, TraceRLConfig, DiffusionValueConfig):
        with pytest.raises(ValueError, match="attention_backend"):
            config_cls(output_dir="unused", attention_backend="xformers", use_cpu=True, bf16=False)


def test_block_mask_refuses_a_cache_and_attention_dropout():
    model = tiny_model("llada")
    ids = torch.tensor([[20, 21, 22, 23]])
    layout = AttentionLayout.plain(torch.arange(4)[None], torch.ones(1, 4, dtype=torch.bool), None)
    with torch.no_grad():
        block_mask = layout.attention_mask("flex")
    cache = DiffusionCache()
    model(input_ids=ids, past_key_values=cache, store_kv=True)
    with pytest.raises(ValueError, match="BlockMask"):
        model(input_ids=ids, attention_mask=block_mask, past_key_values=cache)
    torch.manual_seed(0)
    dropping = LLaDAModelLM(tiny_llada_config(attention_dropout=0.1)).train()
    with pytest.raises(ValueError, match="dropout"):
        dropping(input_ids=ids, attention_mask=block_mask)


def test_sft_trainer_evaluates_the_same_loss_with_either_backend(tmp_path):
    """The config switch reaches the forward: evaluation (no grad) gives the same loss through flex and SDPA."""
    data = Dataset.from_list([{"prompt": "What is 12+7?\n", "completion": "\\boxed{19}"},
                              {"prompt": "What is 5-5?\n", "completion": "\\boxed{0}"}])
    losses = {}
    for backend in ("sdpa", "flex"):
        args = DiffusionSFTConfig(output_dir=str(tmp_path / backend), report_to=[], bf16=False, save_strategy="no",
                                  use_cpu=True, max_length=64, disable_tqdm=True, per_device_eval_batch_size=2,
                                  attention_backend=backend)
        trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=args, train_dataset=data, eval_dataset=data,
                                      processing_class=TOKENIZER)
        losses[backend] = trainer.evaluate()["eval_loss"]
    assert losses["sdpa"] > 0
    assert losses["flex"] == pytest.approx(losses["sdpa"], rel=1e-5)
