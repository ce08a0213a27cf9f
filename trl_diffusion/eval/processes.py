"""Data-parallel evaluation: under ``accelerate launch`` / ``torchrun`` each process generates and scores its share
of the samples on its own device, and the main process gathers the rows, computes the report and writes the files.

A sample's random draws are keyed by (seed, problem, sample) (``stable_seed``), so a launch of any size produces the
samples a single process would.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def launch_world_size() -> int:
    """The number of processes of the launch this process belongs to (``WORLD_SIZE``; 1 without a launch)."""
    return int(os.environ.get("WORLD_SIZE") or 1)  # an empty value is no launch either


def check_launch_device(device: str | None, world_size: int | None) -> None:
    """Raise for a ``device`` that pins every process of a launch to one GPU: each process uses its own
    (``LOCAL_RANK``), so only ``cpu``, ``cuda`` without an index, or no device at all, make sense. ``world_size``
    None: a launch about to start, whose number of processes its accelerate config decides."""
    pinned = device is not None and torch.device(device).type != "cpu" and torch.device(device).index is not None
    if (world_size is None or world_size > 1) and pinned:
        processes = "processes" if world_size is None else f"{world_size} processes"
        raise ValueError(f"device {device!r} would put all {processes} of this launch on one GPU: each process "
                         "evaluates on its own (LOCAL_RANK). Leave --device unset (or pass 'cuda').")


@dataclass(frozen=True)
class EvalProcesses:
    """This process's place in the launch: ``rank`` of ``world_size``, and the ``device`` the launch gives it
    (None for a single process, which picks its own)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device | None = None

    @classmethod
    def from_launch(cls) -> EvalProcesses:
        """A single process without a launch; otherwise accelerate's ``PartialState`` joins the process group (NCCL
        on GPUs, gloo on CPUs) and picks the process's GPU. Rank and size are read from the group itself: on a
        machine without GPUs, accelerate's ``--multi_gpu`` launch joins it but its state reports one process."""
        if launch_world_size() == 1:
            return cls()
        from accelerate import PartialState

        state = PartialState(cpu=not torch.cuda.is_available())
        return cls(torch.distributed.get_rank(), torch.distributed.get_world_size(), state.device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, work: list) -> list:
        """This process's items of ``work``: every ``world_size``-th from its rank (work sorted by prompt length
        keeps each process's batches as evenly padded and the processes' loads as even as one process's)."""
        return work[self.rank:: self.world_size]

    def gather(self, value: Any) -> list[Any]:
        """Every process's ``value``, in rank order, on every process (picklable objects)."""
        if self.world_size == 1:
            return [value]
        values: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(values, value)
        return values

    def share(self, value: Any) -> Any:
        """The main process's ``value``, on every process."""
        if self.world_size == 1:
            return value
        box = [value if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def on_main(self, step: Callable[[], T]) -> T:
        """``step()`` on the main process, its result on every process. An error it raises is raised on every
        process (there as it was, elsewhere as :func:`shared_error`), so none waits for the main one."""
        result, error = None, None
        if self.is_main:
            try:
                result = step()
            except Exception as raised:
                if self.world_size == 1:
                    raise
                error = raised
        result, said = self.share((result, None if error is None else (type(error).__name__, describe(error))))
        if error is not None:
            raise error
        if said is not None:
            raise shared_error(0, *said)
        return result


def describe(error: BaseException) -> str:
    """``str(error)``, or its ``repr`` / class name where that fails: what a process tells the others of its error
    (a failing ``str`` must not keep the message from them, or they would wait in the collective)."""
    for show in (str, repr):
        try:
            return show(error)
        except Exception:
            continue
    return type(error).__name__


def shared_error(rank: int, kind: str, message: str) -> Exception:
    """The error the other processes of a launch raise for process ``rank``'s ``kind: message``: a ValueError for a
    ValueError (the command line prints it as a usage error), a RuntimeError for anything else."""
    return (ValueError if kind == "ValueError" else RuntimeError)(
        f"process {rank} of this launch failed: {kind}: {message}")


def check_same_inputs(inputs: list[dict[str, str]]) -> None:
    """Raise, naming what differs, unless every process evaluates the same model on the same problems (``inputs``:
    each process's identifiers, in rank order): each process scores a share of the samples, so a process with other
    problems (a dataset shuffled without a seed) or another model would mix its rows into the report."""
    differing = sorted({key for values in inputs for key in values if values.get(key) != inputs[0].get(key)})
    if differing:
        raise ValueError(f"the processes of this launch evaluate different {' and '.join(differing)}: every process "
                         "must load the same model and the same problems (the same rows in the same order).")


def merge_runs(runs: list[tuple[list[dict], float, int]]) -> tuple[list[dict], float, int]:
    """One run from every process's ``(rows, generation seconds, forward passes)``: the rows in (problem, sample)
    order, the seconds of the slowest process (they generated at the same time), the forward passes of all."""
    rows = sorted((row for part, _, _ in runs for row in part), key=lambda r: (r["index"], r["sample"]))
    return rows, max(seconds for _, seconds, _ in runs), sum(passes for _, _, passes in runs)
