"""The sandbox directory is removed whatever the program made of it. ``shutil.rmtree`` recurses once per level: a
tree nested past Python's recursion limit raised a RecursionError out of the run's cleanup, which turned a passing
program into a sandbox error and left the tree in the host's temp directory (where the run's directory is not a
tmpfs of its own: hosts without mount namespaces)."""

import os
import stat
import sys
import tempfile

import pytest

from trl_diffusion.rewards.sandbox import _make_searchable, _rmtree

NOBODY = 65534


def _nest(root: str, depth: int, name: str = "d") -> None:
    """``depth`` directories, each inside the last, made by descriptor (the path outgrows PATH_MAX)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir(name, dir_fd=fd)
        inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = inner
    with open(os.open("leaf.txt", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "w") as handle:
        handle.write("x")
    os.fchmod(fd, 0o000)  # the deepest directory without permissions
    os.close(fd)


def test_a_tree_deeper_than_the_recursion_limit_is_removed(tmp_path):
    root, outside = tmp_path / "run", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "kept.txt").write_text("the host's")
    _nest(str(root), sys.getrecursionlimit() + 200)
    _nest(str(root), 20, name="n" * 255)  # names of the longest kind: the path passes PATH_MAX within 17 levels
    os.symlink(outside, root / "link")  # a link is removed, never followed
    (root / ".trl_diffusion_removed_0").mkdir()  # a name the removal would move an entry to
    locked = root / "locked"
    locked.mkdir()
    (locked / "f").write_text("y")
    locked.chmod(0o000)
    _rmtree(str(root))
    assert not root.exists()
    assert (outside / "kept.txt").read_text() == "the host's"


def test_an_ordinary_tree_is_removed(tmp_path):
    root = tmp_path / "run"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_text("z")
    _rmtree(str(root))
    assert not root.exists()


def _as_an_ordinary_user(check) -> None:
    """Run ``check`` with an ordinary user's permissions: as root (which bypasses permission bits, so a test run as
    root shows nothing) in a forked child that becomes uid 65534; otherwise here."""
    if os.geteuid() != 0:
        check(tempfile.mkdtemp())
        return
    base = tempfile.mkdtemp(dir="/tmp")
    os.chown(base, NOBODY, NOBODY)
    try:
        pid = os.fork()
        if pid == 0:  # the child: its modules are loaded already, it only drops its user
            status = 1
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                check(base)
                status = 0
            finally:
                os._exit(status)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    finally:
        _rmtree(base)  # as root: whatever the child left


def _read_only_directories_are_removed(base: str) -> None:
    root = os.path.join(base, "run")
    os.makedirs(os.path.join(root, "a", "b", "c"))
    for name in ("f", "b/f", "b/c/f"):
        with open(os.path.join(root, "a", name), "w") as handle:
            handle.write("x")
    os.chmod(os.path.join(root, "a", "b", "c"), 0o555)  # what a program may do to its own directories
    os.chmod(os.path.join(root, "a", "b"), 0o500)
    _nest(root, sys.getrecursionlimit() + 100)
    _rmtree(root)
    assert not os.path.exists(root)


def test_read_only_directories_are_removed_by_an_ordinary_user():
    # moving a read-only directory to another parent needs write permission on it (its ".." entry): one two levels
    # down was left behind when the sandbox ran as an ordinary user
    _as_an_ordinary_user(_read_only_directories_are_removed)


def test_making_a_directory_searchable_never_follows_a_link(tmp_path):
    """The removal's chmod of a sub-directory goes through a descriptor opened without following links: a program
    that swaps a directory for a link (a race against the leftover sweep, run as root) changes no other path's mode."""
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o751)
    outside.chmod(0o751)
    (tmp_path / "run").mkdir()
    os.symlink(outside, tmp_path / "run" / "swapped")
    (tmp_path / "run" / "locked").mkdir()
    (tmp_path / "run" / "locked").chmod(0o000)
    top = os.open(tmp_path / "run", os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(NotADirectoryError):
            _make_searchable("swapped", top)
        _make_searchable("locked", top)
    finally:
        os.close(top)
    assert stat.S_IMODE(outside.stat().st_mode) == 0o751
    assert stat.S_IMODE((tmp_path / "run" / "locked").stat().st_mode) == 0o700
