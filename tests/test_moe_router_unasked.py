"""Forwards whose router logits nobody uses never ask for them, even when a mixture-of-experts config says
``output_router_logits`` (as TRL leaves it after an SFT run with the load-balancing loss on): the value model, the
step-by-step trajectory replay, and the placeholder forwards that keep processes in step under FSDP / ZeRO-3. Their
outputs are the same either way; asking would only compute unused router logits."""

import pytest
import torch

from trl_diffusion.estimators.trajectory import replay_logprobs
from trl_diffusion.models.moe import SparseMoeBlock
from trl_diffusion.synced_forwards import synced_forwards, zero_forward_term
from trl_diffusion.testing import tiny_moe_model
from trl_diffusion.value import DiffusionValueModel

FAMILIES = ["sdar_moe", "llada_moe"]


def sparse_block_requests(model: torch.nn.Module) -> list[bool]:
    """From now on, whether each call of one of ``model``'s sparse blocks asked for its router logits."""
    requests = []
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.register_forward_pre_hook(
                lambda m, args, kwargs: requests.append(bool(kwargs.get("output_router_logits"))), with_kwargs=True)
    return requests


def config_says_router_logits(*models) -> None:
    for model in models:
        model.config.output_router_logits = True


@pytest.mark.parametrize("family", FAMILIES)
def test_value_model_asks_for_no_router_logits(family):
    value_model = DiffusionValueModel.from_policy(tiny_moe_model(family))
    with torch.no_grad():
        value_model.value_head.weight.normal_(generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        before = value_model(input_ids=ids).value
        config_says_router_logits(value_model, value_model.model)
        requests = sparse_block_requests(value_model)
        after = value_model(input_ids=ids).value
    assert requests and not any(requests)
    assert torch.equal(after, before)


@pytest.mark.parametrize("family", FAMILIES)
def test_trajectory_replay_asks_for_no_router_logits(family):
    model = tiny_moe_model(family)
    prompt = torch.tensor([[5, 6, 7], [8, 9, 10]])
    out = model.generate(prompt, max_new_tokens=8, block_length=4, temperature=1.0, stop_token_ids=[],
                         generator=torch.Generator().manual_seed(0), return_dict_in_generate=True)
    args = (out.sequences, torch.ones_like(prompt), out.unmask_step)
    with torch.no_grad():
        before = replay_logprobs(model, *args, block_length=4)
        config_says_router_logits(model)
        requests = sparse_block_requests(model)
        after = replay_logprobs(model, *args, block_length=4)
    assert requests and not any(requests)
    assert torch.equal(after, before)


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_forward_term_asks_for_no_router_logits(family):
    model = tiny_moe_model(family)
    config_says_router_logits(model)
    requests = sparse_block_requests(model)
    term = zero_forward_term(model, torch.tensor([[5, 6]]))
    assert requests and not any(requests)
    assert term.item() == 0.0 and term.requires_grad


def test_synced_placeholder_forwards_ask_for_no_router_logits(monkeypatch):
    """On leaving ``synced_forwards`` a process runs placeholder forwards while another still decodes: simulated
    here by an all-reduce that reports one busy process once, then none."""
    import trl_diffusion.synced_forwards as synced

    busy_reports = iter([1, 0])

    def all_reduce(tensor, op=None):
        tensor.fill_(next(busy_reports))

    monkeypatch.setattr(synced.dist, "all_reduce", all_reduce)
    model = tiny_moe_model("sdar_moe")
    config_says_router_logits(model)
    requests = sparse_block_requests(model)
    with synced_forwards(model, True, torch.tensor([[5]])):
        pass
    assert requests and not any(requests)
    assert next(busy_reports, "spent") == "spent"
