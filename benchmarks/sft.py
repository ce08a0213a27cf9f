"""What packing saves in diffusion SFT: one epoch of ``DiffusionSFTTrainer`` training steps, padded vs packed vs
padding-free, on the same samples, and the ``trajectory`` objective's packed layout against one row per state, as
JSON.

Samples have the spread of lengths SFT data has (prompt and answer lengths drawn from a seeded log-normal, clipped
to ``max_length``); tokens are random (no tokenizer, no download), the model a random SDAR (``block``) or LLaDA
(``random_masking``) of the preset's shape. Each mode trains the same samples for one epoch, the batches of a
mode holding about the same number of real tokens (``tokens_per_step``): ``padded`` takes that many tokens' worth of
samples per batch, padded to the longest; ``packed`` TRL's best-fit-decreasing rows of ``max_length`` tokens;
``padding_free`` the padded mode's batches, each in one row. Attention is ``attention_backend="auto"``: SDPA on the
CPU, compiled flex attention on CUDA for bf16 models with head_dim 128 (it skips other documents' tiles). Every
record has seconds, real tokens/s, the padding share of what the forward processed and (CUDA) peak memory; the
summary puts each mode's tokens/s beside the padded one's.

    python benchmarks/sft.py                          # CPU, SDAR and LLaDA, hidden 128 (attention-bound)
    python benchmarks/sft.py --preset medium          # CPU, SDAR, hidden 512 (linear layers weigh more)
    python benchmarks/sft.py --preset tiny            # a few seconds (what the test runs)
    python benchmarks/sft.py --preset sdar-1.7b --device cuda --output sft.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from pathlib import Path

import torch

PRESETS = {
    "small": dict(families=["sdar", "llada"], hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                  intermediate=512, vocab=512, samples=96, max_length=512, tokens_per_step=2048, dtype="float32",
                  trajectory=dict(samples=4, prompt=64, answer=256)),
    "medium": dict(families=["sdar"], hidden=512, layers=2, heads=8, kv_heads=4, head_dim=64, intermediate=1536,
                   vocab=4096, samples=64, max_length=512, tokens_per_step=2048, dtype="float32",
                   trajectory=dict(samples=4, prompt=64, answer=256)),
    "tiny": dict(families=["sdar"], hidden=64, layers=1, heads=2, kv_heads=1, head_dim=32, intermediate=128,
                 vocab=128, samples=12, max_length=64, tokens_per_step=192, dtype="float32",
                 trajectory=dict(samples=2, prompt=8, answer=16)),
    "sdar-1.7b": dict(families=["sdar"], hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128,
                      intermediate=6144, vocab=151936, samples=256, max_length=4096, tokens_per_step=16384,
                      dtype="bfloat16", checkpointing=True, trajectory=dict(samples=1, prompt=128, answer=128)),
}
MODES = ("padded", "packed", "padding_free")
BLOCK = 4


def sample_lengths(count: int, max_length: int, seed: int = 0) -> list[tuple[int, int]]:
    """``(prompt, answer)`` lengths: log-normal around max_length / 8 and / 4 (a long tail, as in SFT data),
    together at most ``max_length``."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(count):
        prompt = max(4, min(max_length // 2, round(rng.lognormvariate(math.log(max_length / 8), 0.6))))
        answer = max(4, min(max_length - prompt, round(rng.lognormvariate(math.log(max_length / 4), 0.8))))
        lengths.append((prompt, answer))
    return lengths


def tokenized_samples(lengths: list[tuple[int, int]], vocab: int, seed: int = 0) -> list[dict]:
    """Rows as SFT takes them tokenized: ``input_ids`` and ``completion_mask`` (random ids, never the mask token
    ``vocab - 1`` or the pad / EOS id 0)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for prompt, answer in lengths:
        ids = torch.randint(1, vocab - 1, (prompt + answer,), generator=generator).tolist()
        rows.append({"input_ids": ids, "completion_mask": [0] * prompt + [1] * answer})
    return rows


def build_model(family: str, shape: dict, device: str):
    """A random-weight model of ``shape`` (the test configs' other fields), built on ``device`` in its dtype."""
    from trl_diffusion.testing import MODEL_CLASSES, tiny_llada_config, tiny_sdar_config

    ids = dict(mask_token_id=shape["vocab"] - 1, pad_token_id=0, eos_token_id=0)
    if family == "sdar":
        config = tiny_sdar_config(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                                  num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                                  num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                                  intermediate_size=shape["intermediate"], block_size=BLOCK,
                                  max_position_embeddings=shape["max_length"] + 64, bos_token_id=0, **ids)
    else:
        config = tiny_llada_config(d_model=shape["hidden"], n_layers=shape["layers"], n_heads=shape["heads"],
                                   n_kv_heads=shape["kv_heads"], mlp_hidden_size=shape["intermediate"],
                                   vocab_size=shape["vocab"], embedding_size=shape["vocab"],
                                   max_sequence_length=shape["max_length"] + 64, **ids)
    torch.manual_seed(0)
    with torch.device(device):
        return MODEL_CLASSES[family]._from_config(config, dtype=getattr(torch, shape["dtype"]))


def tokenizer_for(vocab: int):
    """A word-level tokenizer over ``vocab`` ids (the trainer needs one; the data is already tokenized)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokens = {f"t{i}": i for i in range(vocab)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(tokens, unk_token="t1")))
    tokenizer.add_special_tokens({"eos_token": "t0", "pad_token": "t0", "mask_token": f"t{vocab - 1}"})
    return tokenizer


def measure(family: str, mode: str, shape: dict, device: str) -> dict:
    """One epoch of training steps in ``mode``: seconds (after one untimed warm-up step), real tokens, processed
    columns."""
    from datasets import Dataset

    from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer

    rows = tokenized_samples(sample_lengths(shape["samples"], shape["max_length"]), shape["vocab"])
    mean_length = sum(len(r["input_ids"]) for r in rows) / len(rows)
    per_batch = max(1, round(shape["tokens_per_step"] / mean_length))
    settings = {"padded": {}, "packed": {"packing": True},
                "padding_free": {"padding_free": True, "max_length": None}}[mode]
    if mode == "packed":
        per_batch = max(1, round(shape["tokens_per_step"] / shape["max_length"]))
    with tempfile.TemporaryDirectory() as output_dir:
        args = DiffusionSFTConfig(**{
            "output_dir": output_dir, "report_to": [], "use_cpu": device == "cpu", "bf16": False,
            "save_strategy": "no", "max_length": shape["max_length"], "per_device_train_batch_size": per_batch,
            "gradient_checkpointing": shape.get("checkpointing", False), "completion_only_loss": True,
            "shuffle_dataset": False, "dataloader_pin_memory": False, "disable_tqdm": True,
            "attention_backend": "auto", **settings})
        model = build_model(family, shape, device)
        trainer = DiffusionSFTTrainer(model, args=args, train_dataset=Dataset.from_list(rows),
                                      processing_class=tokenizer_for(shape["vocab"]))
        batches = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                   for batch in trainer.get_train_dataloader()]
        model.train()
        trainer.create_optimizer()
        trainer.training_step(model, batches[0], num_items_in_batch=_labels(batches[0]))  # warm-up
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for batch in batches:
            trainer.training_step(model, batch, num_items_in_batch=_labels(batch))
            trainer.optimizer.step()
            trainer.optimizer.zero_grad()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    real = sum(_real_tokens(batch) for batch in batches)
    processed = sum(batch["input_ids"].numel() for batch in batches)
    record = {"family": family, "mode": mode, "steps": len(batches), "samples_per_batch": per_batch,
              "seconds": round(seconds, 3), "real_tokens": real, "real_tokens_per_s": round(real / seconds, 1),
              "padding_share": round(1 - real / processed, 3)}
    if torch.device(device).type == "cuda":
        record["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return record


def measure_trajectory(shape: dict, device: str, samples: int = 4, prompt: int = 64, answer: int = 256,
                       steps_per_block: int = 4) -> list[dict]:
    """The ``trajectory`` objective on SDAR rollouts (block 4, ``steps_per_block`` steps a block: with 4, one token
    per step, TraceRL's worst case, so ``answer`` states a sample): one forward + backward in TraceRL's packed
    layout (what the objective builds) and in one whole row per state (``trajectory_state_rows``), on one batch;
    each timed after an untimed warm-up call."""
    from trl_diffusion.states import block_index, step_groups
    from trl_diffusion.trainers.diffusion_losses import (
        IGNORE_INDEX,
        build_objective,
        diffusion_loss,
        trajectory_state_rows,
    )

    model = build_model("sdar", shape, device).train()
    if shape.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, shape["vocab"] - 1, (samples, prompt + answer), generator=generator)
    completion = torch.arange(prompt + answer)[None].expand_as(ids) >= prompt
    labels = torch.where(completion, ids, IGNORE_INDEX)
    blocks = block_index(torch.arange(prompt + answer), BLOCK)[None].expand_as(ids)
    within = (torch.arange(prompt + answer) % BLOCK % steps_per_block)[None].expand_as(ids)
    unmask_step = torch.where(completion, (blocks - prompt // BLOCK) * steps_per_block + within, -1)
    valid = torch.ones_like(completion)
    # built on the device, so that the layouts (and their attention masks) are there too
    ids, completion, labels, blocks, unmask_step, valid = (
        t.to(device) for t in (ids, completion, labels, blocks, unmask_step, valid))
    layouts = {
        "packed": build_objective("trajectory", ids, labels, valid, [], mask_token_id=shape["vocab"] - 1,
                                  block_size=BLOCK, unmask_step=unmask_step),
        "one row per state": trajectory_state_rows(ids, completion, valid, step_groups(unmask_step, 1, blocks),
                                                   shape["vocab"] - 1, BLOCK),
    }
    records = []
    on_cuda = torch.device(device).type == "cuda"
    for name, batch in layouts.items():
        for _ in range(2):  # a warm-up call, then the timed one (flex attention on CUDA compiles in the first)
            model.zero_grad(set_to_none=True)
            if on_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss, _ = diffusion_loss(model, batch, int(completion.sum()), False, shape["vocab"] - 1, "nll", "auto")
            loss.backward()
            if on_cuda:
                torch.cuda.synchronize()
        records.append({"family": "sdar", "mode": f"trajectory, {name}", "rows": batch.input_ids.shape[0],
                        "processed_tokens": batch.input_ids.numel(), "seconds": round(time.perf_counter() - start, 3),
                        "loss": round(loss.item(), 4)})
    return records


def _labels(batch: dict) -> torch.Tensor:
    return batch["labels"].ne(-100).sum()


def _real_tokens(batch: dict) -> int:
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["document_ids"].ge(0).sum())


def summarize(records: list[dict]) -> dict:
    """Each mode's real tokens/s over the padded mode's, per family; the trajectory objective's per-state rows'
    seconds over the packed layout's."""
    ratios = {}
    for record in records:
        if record["mode"] in MODES and record["mode"] != "padded":
            padded = next(r for r in records if r["family"] == record["family"] and r["mode"] == "padded")
            ratios[f"{record['family']} {record['mode']} / padded"] = round(
                record["real_tokens_per_s"] / padded["real_tokens_per_s"], 2)
    seconds = {r["mode"]: r["seconds"] for r in records if r["mode"].startswith("trajectory")}
    if len(seconds) == 2:
        ratios["sdar trajectory: one row per state / packed (seconds)"] = round(
            seconds["trajectory, one row per state"] / seconds["trajectory, packed"], 1)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), default="small")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--families", nargs="+", choices=["sdar", "llada"])
    parser.add_argument("--output", type=Path, help="also write the records and ratios to this JSON file")
    args = parser.parse_args()
    shape = PRESETS[args.preset]
    records = []
    families = args.families or shape["families"]
    for family in families:
        for mode in MODES:
            records.append(measure(family, mode, shape, args.device))
            print(json.dumps(records[-1]), flush=True)
    if "sdar" in families:
        for record in measure_trajectory(shape, args.device, **shape["trajectory"]):
            records.append(record)
            print(json.dumps(record), flush=True)
    result = {"preset": args.preset, "device": args.device, "records": records, "ratios": summarize(records)}
    if args.output:
        args.output.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["ratios"], indent=1))


if __name__ == "__main__":
    main()
