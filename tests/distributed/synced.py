"""Two processes (gloo) whose decoding and scoring run different numbers of forwards; run by
tests/test_synced_forwards.py with torch.distributed.run. Writes rank<i>.json into the folder given as argv[1]."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trl_diffusion.estimators import EstimatorSettings, estimate_logprobs, likelihood
from trl_diffusion.launching import pause_for_gloo_workers
from trl_diffusion.testing import tiny_model
from trl_diffusion.value import DiffusionValueModel, value_model
from trl_diffusion.value.value_model import token_values


def counted(model):
    """``model`` with a forward counter (registered first: it also sees the dummy forwards)."""
    model.forwards = 0

    def count(module, args):
        module.forwards += 1

    model.register_forward_pre_hook(count)
    return model


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"rank": rank}
    model = counted(tiny_model("sdar"))
    ids = torch.tensor([[5, 6, 7]])
    kw = dict(max_new_tokens=4 if rank == 0 else 16, block_length=4, denoising_steps=4, temperature=0.0,
              stop_token_ids=[], use_cache=True, return_dict_in_generate=True)
    for synced in (False, True):
        model.forwards = 0
        output = model.generate(ids, synced_gpus=synced, **kw)
        result[f"generate_forwards_{synced}"] = model.forwards
        result[f"sequences_{synced}"] = output.sequences.tolist()
    # scoring: one row here, three on rank 1, one chunk per row (token budget)
    rows = 1 if rank == 0 else 3
    prompt = ids.repeat(rows, 1)
    rollout = model.generate(prompt, max_new_tokens=8, block_length=4, denoising_steps=2, temperature=0.0,
                             stop_token_ids=[], return_dict_in_generate=True)
    completion, steps = rollout.sequences[:, 3:], rollout.unmask_step[:, 3:]
    settings = EstimatorSettings(block_size=4, token_budget=24)
    value = counted(DiffusionValueModel.from_policy(tiny_model("sdar")))
    for synced in (False, True):
        likelihood.needs_synced_forwards = value_model.needs_synced_forwards = lambda model, synced=synced: synced
        model.zero_grad()
        model.forwards = value.forwards = 0
        logps, _, _ = estimate_logprobs(model, prompt, torch.ones_like(prompt), completion, steps, settings)
        logps.sum().backward()
        values, _ = token_values(value, prompt, torch.ones_like(prompt), completion, steps, token_budget=24)
        result[f"score_forwards_{synced}"] = model.forwards
        result[f"value_forwards_{synced}"] = value.forwards
        result[f"logps_{synced}"] = logps.tolist()
        result[f"values_{synced}"] = values.tolist()
        result[f"grad_{synced}"] = model.lm_head.weight.grad.abs().sum().item()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    pause_for_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
