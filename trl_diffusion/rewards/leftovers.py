"""What a sandbox run leaves behind when the trainer is killed mid-run, and its removal by the next trainer.

A run's parent removes the run's working directory and cgroups in a ``finally``. A SIGTERM or SIGKILL (a preempted
job, ``torchrun`` stopping its workers, a scheduler's time limit) ends the process without it. The sandbox itself
ends with its parent (its watchdog watches a pipe only the parent writes to; where ``setpriv`` exists, the kernel
kills its PID namespace), so what is left is the directory (with whatever the program wrote to it where no tmpfs was
mounted over it) and empty cgroups. The first sandbox run
of each process removes what dead processes left:

* a working directory is in use while its creator holds an ``flock`` on it, which the kernel releases when the
  holder dies, however it dies (a PID namespace or a reused pid cannot fool it). A directory with the sandbox's
  prefix that nobody holds, and that was last modified over a minute ago (so no live run is between making it and
  locking it), is removed.
  Only directories (never links) owned by this user, or as root by root or a per-run uid, are taken. As root, the
  directory of a run whose program had a uid of its own also takes that uid's processes and its files directly in
  the shared temp directories (which it could write to without a mount namespace and Landlock), unless a live
  process has that uid's pid slot (a new trainer with the dead one's pid makes the same uids).
* a per-run cgroup is named after its creator's pid. One whose creator is not running is removed when it holds no
  process (the kernel refuses to remove a cgroup that does) and is over a minute old (a creator in another PID
  namespace looks gone from here, and a live run's cgroup is empty until its sandbox joins it).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import threading
import time

__all__ = ["FRESH_UID_PREFIX", "WORKDIR_PREFIX", "new_workdir", "remove_orphaned_workdirs", "sweep_once"]

WORKDIR_PREFIX = "trl_diffusion_run_"  # not the unlocked directories' earlier "trl_diffusion_sandbox_"
FRESH_UID_PREFIX = WORKDIR_PREFIX + "uid-"
"""The directories of runs whose program ran as a fresh per-run uid (root's sandboxes). ``mkdtemp``'s random names
(``[a-z0-9_]``) never hold a ``-``, so no other run's directory starts like this."""
_MIN_AGE = 60.0
_swept = False
_SWEEP_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A fork made during a sweep would wait forever on the lock another thread held: the fork gets a fresh one."""
    global _SWEEP_LOCK
    _SWEEP_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def new_workdir(fresh_uid: bool = False) -> tuple[str, int]:
    """A fresh directory in the host's temp directory for one run, and a descriptor holding an exclusive ``flock`` on
    it (the mark of a directory in use); close the descriptor after removing the directory. ``fresh_uid``: the run's
    program runs as a uid of its own (named by :data:`FRESH_UID_PREFIX`, so a sweep may end what that uid left)."""
    path = tempfile.mkdtemp(prefix=FRESH_UID_PREFIX if fresh_uid else WORKDIR_PREFIX)
    fd = -1
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        os.rmdir(path)
        raise
    return path, fd


def remove_orphaned_workdirs(directory: str | None = None, min_age: float = _MIN_AGE) -> list[str]:
    """Remove the sandbox directories in ``directory`` (default: the temp directory) that no live process holds and
    that were last modified more than ``min_age`` seconds ago; returns their paths.

    Only directories (never links) owned by this user are taken, or, as root, by root or a per-run uid. As root, the
    directory of a run whose program had a fresh uid of its own (:data:`FRESH_UID_PREFIX`, owned by that uid) also
    takes what else that uid left: its processes (a killed trainer's run where nothing killed them, e.g. a process
    that left the run's process group where the seccomp filter is missing) and its files directly in ``/tmp``,
    ``/var/tmp`` and ``/dev/shm`` (without a mount namespace and Landlock it could write there; a run's normal end
    removes them), unless a live process has that uid's pid slot (it may be running a sandbox as that uid again)."""
    from .sandbox import _UID_BASE, _kill_uid, _remove_files_of, _rmtree, _uid_slot_in_use

    directory = directory or tempfile.gettempdir()
    uid = os.geteuid()
    removed = []
    try:
        entries = [entry for entry in os.scandir(directory) if entry.name.startswith(WORKDIR_PREFIX)]
    except OSError:
        return removed
    for entry in entries:
        fd = -1
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            info = os.fstat(fd)
            owned = info.st_uid == uid or (uid == 0 and info.st_uid >= _UID_BASE)
            if not owned or time.time() - info.st_mtime < min_age:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a live run holds it
            fresh = uid == 0 and info.st_uid >= _UID_BASE and entry.name.startswith(FRESH_UID_PREFIX)
            if fresh and not _uid_slot_in_use(info.st_uid):  # a live process may be using that uid again
                _kill_uid(info.st_uid)
                _remove_files_of(info.st_uid)
            if _rmtree(entry.path):
                removed.append(entry.path)
        except OSError:  # a link (ELOOP), not a directory, held by a live run, or gone already
            continue
        finally:
            if fd >= 0:
                os.close(fd)
    return removed


def sweep_once(cgroup_roots: tuple[object, ...] = ()) -> None:
    """Once per process: remove the working directories and cgroups (under each of ``cgroup_roots``, a
    :class:`~trl_diffusion.rewards.cgroup.CgroupRoot` or ``None``) that processes killed mid-run left behind."""
    global _swept
    if _swept:
        return
    with _SWEEP_LOCK:
        if _swept:
            return
        try:
            removed = remove_orphaned_workdirs()
            removed += [path for root in cgroup_roots if root is not None for path in root.remove_orphans()]
        except Exception as error:  # housekeeping: never a reason for a run to fail, nor to try again every run
            logging.getLogger(__name__).warning("Could not remove what killed runs left behind: %r", error)
            removed = []
        finally:
            _swept = True
    if removed:
        logging.getLogger(__name__).info(
            "Removed %d sandbox directories and cgroups left by processes killed during a run: %s",
            len(removed),
            ", ".join(removed[:5]) + (" ..." if len(removed) > 5 else ""),
        )
