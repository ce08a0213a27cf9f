"""How often a two-process gloo run hangs when it leaves its process group, with and without
``trl_diffusion.launching.pause_for_gloo_workers`` (the measurement behind that pause).

Each run launches two processes with ``torch.distributed.run``; each broadcasts a few tensors made in Python, meets
the other at a barrier and calls ``destroy_process_group``. A run that has not ended after ``--timeout`` seconds
counts as hung. The hang needs busy cores (gloo's worker thread must lose the race for the GIL), so the script keeps
``--busy`` spinning processes running meanwhile. Prints one JSON record::

    python scripts/gloo_exit_check.py --runs 20            # without the pause
    python scripts/gloo_exit_check.py --runs 20 --pause    # with it
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys

import torch


def worker(pause: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for _ in range(3):
        dist.broadcast(torch.tensor([float(dist.get_rank())]), 0)  # its tensor's last reference: gloo's thread
    dist.barrier()
    if pause:
        from trl_diffusion.launching import pause_for_gloo_workers

        pause_for_gloo_workers()
    dist.destroy_process_group()


def spin() -> None:
    while True:
        sum(range(10**6))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--pause", action="store_true", help="call pause_for_gloo_workers before leaving")
    parser.add_argument("--busy", type=int, default=2, help="spinning processes that keep the cores busy")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds after which a run counts as hung")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.pause)
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for process in spinners:
        process.start()
    hung = 0
    try:
        for _ in range(args.runs):
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                       str(free_port()), __file__, "--worker"] + (["--pause"] if args.pause else [])
            launched = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
            try:
                launched.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                hung += 1
                os.killpg(launched.pid, signal.SIGKILL)  # the launcher and both workers
                launched.wait()
            else:
                if launched.returncode != 0:
                    raise SystemExit(f"a run failed (exit status {launched.returncode}): {' '.join(command)}")
    finally:
        for process in spinners:
            process.terminate()
    print(json.dumps({"torch": torch.__version__, "pause": args.pause, "busy": args.busy, "runs": args.runs,
                      "hung": hung}))


if __name__ == "__main__":
    main()
