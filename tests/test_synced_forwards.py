"""Every process runs the same number of forwards where FSDP / ZeRO-3 make each forward a collective: decoding with
``synced_gpus`` (announce, then dummy forwards until no process decodes) and packed scoring (an agreed number of
chunk forwards, padded with forwards that contribute zero). Two gloo processes on the CPU, whose decodes and scoring
differ in length; outputs and gradients must be those of the unsynced run."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_diffusion.testing import tiny_model

SCRIPT = Path(__file__).parent / "distributed" / "synced.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("synced")
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               str(SCRIPT), str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_synced_decoding_runs_as_many_forwards_on_every_process(ranks):
    unsynced = [r["generate_forwards_False"] for r in ranks]
    assert unsynced[0] < unsynced[1]  # 4 new tokens on rank 0, 16 on rank 1: the hang FSDP would meet
    assert ranks[0]["generate_forwards_True"] == ranks[1]["generate_forwards_True"] == unsynced[1]
    for r in ranks:
        assert r["sequences_True"] == r["sequences_False"]


@pytest.mark.slow
def test_synced_scoring_runs_as_many_forwards_and_changes_nothing(ranks):
    assert ranks[0]["score_forwards_False"] < ranks[1]["score_forwards_False"]
    assert ranks[0]["score_forwards_True"] == ranks[1]["score_forwards_True"] == ranks[1]["score_forwards_False"]
    assert ranks[0]["value_forwards_False"] < ranks[1]["value_forwards_False"]
    assert ranks[0]["value_forwards_True"] == ranks[1]["value_forwards_True"]
    for r in ranks:
        assert r["logps_True"] == r["logps_False"] and r["values_True"] == r["values_False"]
        assert r["grad_True"] == pytest.approx(r["grad_False"], rel=1e-6)


def test_synced_gpus_without_a_process_group_is_an_error():
    with pytest.raises(ValueError, match="needs an initialised torch.distributed process group"):
        tiny_model("sdar").generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, synced_gpus=True)
    with pytest.raises(ValueError, match="synced_gpus must be True, False or None"):
        tiny_model("sdar").generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, synced_gpus="yes")


def test_one_process_needs_no_synced_forwards():
    from trl_diffusion.synced_forwards import needs_synced_forwards

    assert not needs_synced_forwards(tiny_model("sdar"))


def test_value_steps_pad_with_zero_pieces_to_the_agreed_count(tmp_path, monkeypatch):
    """The value model's steps split a process's responses into pieces of per_device_train_batch_size; under FSDP /
    ZeRO-3 every process must run as many as the busiest. Simulated here (one process, a busier peer claiming one
    more piece per step): the extra piece runs a forward and changes nothing."""
    from datasets import Dataset

    from trl_diffusion.testing import build_tokenizer
    from trl_diffusion.trainers import TraceRLConfig, TraceRLTrainer
    from trl_diffusion.trainers import tracerl_trainer as module
    from trl_diffusion.value import DiffusionValueModel

    def train(name):
        value = DiffusionValueModel.from_policy(tiny_model("sdar"))
        value.forwards = 0
        value.register_forward_pre_hook(lambda m, a: setattr(m, "forwards", m.forwards + 1))
        args = TraceRLConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=4, num_generations=4,
                             max_completion_length=8, max_steps=2, report_to="none", learning_rate=0.1,
                             block_length=4, denoising_steps=2, save_strategy="no", use_cpu=True, bf16=False,
                             value_batch_size=2, disable_tqdm=True)
        trainer = TraceRLTrainer(tiny_model("sdar"), lambda completions, **kw: [len(c) % 2 for c in completions],
                                 args=args, train_dataset=Dataset.from_dict({"prompt": ["a", "b", "c", "d"]}),
                                 processing_class=build_tokenizer(), value_model=value)
        trainer.train()
        return value.forwards, torch.cat([p.detach().flatten() for p in value.parameters()])

    forwards, params = train("plain")
    monkeypatch.setattr(module, "needs_synced_forwards", lambda model: True)
    monkeypatch.setattr(module, "agreed_forward_count", lambda count, device, enabled: count + 1)
    padded_forwards, padded_params = train("padded")
    assert padded_forwards > forwards
    torch.testing.assert_close(padded_params, params, rtol=0, atol=1e-6)
