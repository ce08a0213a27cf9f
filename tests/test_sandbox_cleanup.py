"""The sandbox directory is removed whatever the program made of it. ``shutil.rmtree`` recurses once per level: a
tree nested past Python's recursion limit raised a RecursionError out of the run's cleanup, which turned a passing
program into a sandbox error and left the tree in the host's temp directory (where the run's directory is not a
tmpfs of its own: hosts without mount namespaces)."""

import os
import sys

from trl_diffusion.rewards.sandbox import _rmtree


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
