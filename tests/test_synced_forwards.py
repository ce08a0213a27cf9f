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
