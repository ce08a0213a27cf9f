"""Writes ``OUT/rank<i>.json`` with the world this process was launched into (the launcher checks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from accelerate import PartialState

from trl_diffusion.launching import pause_for_gloo_workers

if __name__ == "__main__":
    state = PartialState(cpu=True)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    facts = {"num_processes": state.num_processes, "distributed_type": str(state.distributed_type),
             "backend": state.backend}
    (out / f"rank{state.process_index}.json").write_text(json.dumps(facts))
    state.wait_for_everyone()
    pause_for_gloo_workers()
    state.destroy_process_group()  # leave gloo together: exiting with its threads up can abort the process
