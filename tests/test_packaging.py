"""What ``pip install .`` (a wheel, not the editable install the suite runs on) ships: every module and every data
file of the package. setup.py lists packages with ``find_packages`` (a folder without ``__init__.py`` is left out)
and data files with ``package_data`` globs (a file they do not match is left out); both fail silently, for users
only."""

from pathlib import Path

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
