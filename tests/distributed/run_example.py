"""Run an example script as ``python examples/<name>.py`` runs it (as ``__main__``), then record whether this process
is still in the torch.distributed process group: ``run_example.py <out folder> <script> [its flags]``."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import torch.distributed

if __name__ == "__main__":
    out, script = Path(sys.argv[1]), sys.argv[2]
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")
    facts = {"in_process_group": torch.distributed.is_initialized()}
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(facts))
