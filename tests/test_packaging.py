"""What ``pip install .`` (a wheel, not the editable install the suite runs on) ships: every module and every data
file of the package. setup.py lists packages with ``find_packages`` (a folder without ``__init__.py`` is left out)
and data files with ``package_data`` globs (a file they do not match is left out); both fail silently, for users
only."""

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from test_oldest_versions import setup_argument

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "trl_diffusion"


def package_files() -> list[Path]:
    return [p for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]


def test_every_folder_with_modules_is_a_package():
    folders = {p.parent for p in package_files() if p.suffix == ".py"}
    assert sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file()) == []


def test_every_data_file_is_shipped():
    shipped = {p for glob in setup_argument("package_data")["trl_diffusion"] for p in PACKAGE.glob(glob)}
    data = [p for p in package_files() if p.suffix != ".py"]
    assert data, "the embedded model's files are package data"
    assert sorted(str(p.relative_to(ROOT)) for p in data if p not in shipped) == []


def test_no_bytecode_matches_the_package_data_globs(tmp_path):
    """``assets/**/*`` also matched ``assets/__pycache__/*.pyc``, written by any import of the package where bytecode
    is on (the default): wheels and sdists built there shipped it."""
    for relative in ("assets/__pycache__/__init__.cpython-311.pyc", "assets/tiny-sdar-arithmetic/config.json"):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text("")
    matched = {p.relative_to(tmp_path).as_posix() for glob in setup_argument("package_data")["trl_diffusion"]
               for p in tmp_path.glob(glob)}
    assert matched == {"assets/tiny-sdar-arithmetic/config.json"}


def test_the_declared_license_is_shipped():
    """setup.py declared Apache-2.0 with no license text anywhere (the license requires giving recipients a copy);
    setuptools puts ``LICENSE`` into the wheel's dist-info and MANIFEST.in into the sdist."""
    assert setup_argument("license") == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text


@pytest.mark.slow
def test_the_sdist_carries_its_test_suite_and_no_bytecode(tmp_path):
    """Without MANIFEST.in the sdist held only ``tests/test*.py``: no conftest, helpers, fixtures, examples or docs
    the tests read (58 collection errors, the rest without fixtures)."""
    source = tmp_path / "source"

    def not_sources(folder: str, names: list[str]) -> set[str]:  # a checkout's own outputs, at its top only
        top = Path(folder) == ROOT
        return {name for name in names if name in (".git", ".venv", "__pycache__") or name.endswith(".egg-info")
                or (top and name in ("build", "dist"))}

    shutil.copytree(ROOT, source, ignore=not_sources)
    (source / "tests" / "__pycache__").mkdir(exist_ok=True)
    (source / "tests" / "__pycache__" / "conftest.cpython-311.pyc").write_text("")
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=source, check=True,
                   capture_output=True)
    (archive,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(archive) as sdist:
        members = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    wanted = {"LICENSE", "README.md", "CHANGELOG.md", "setup.py", "constraints/oldest.txt"}
    for folder in ("tests", "examples", "scripts", "docs", "benchmarks", "trl_diffusion/recipes"):
        wanted |= {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    assert sorted(wanted - members) == []
    assert [name for name in members if name.endswith(".pyc") or "__pycache__" in name] == []
