"""constraints/oldest.txt pins every dependency at setup.py's lower bound, so that running the suite on it (see the
file's header) checks the versions the package claims to support, and a raised floor cannot leave it stale."""

import ast
import sys
from importlib.metadata import metadata, packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def setup_argument(name: str):
    """A literal keyword argument of setup.py's ``setup()`` call, read without running it."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py has no {name}")


def install_requires() -> list[Requirement]:
    return [Requirement(text) for text in setup_argument("install_requires")]


def pins(path: Path) -> dict[str, Version]:
    """``name==version`` lines of a constraints file, by canonical name."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            requirement = Requirement(line)
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", line
            found[canonicalize_name(requirement.name)] = Version(specifier.version)
    return found


def test_oldest_constraints_pin_every_lower_bound():
    floors = {}
    for requirement in install_requires():
        lower = [s.version for s in requirement.specifier if s.operator == ">="]
        assert len(lower) == 1, f"{requirement}: give every dependency one lower bound (>=)"
        floors[canonicalize_name(requirement.name)] = Version(lower[0])
    assert pins(ROOT / "constraints" / "oldest.txt") == floors


def test_the_pins_satisfy_the_requirements():
    oldest = pins(ROOT / "constraints" / "oldest.txt")
    for requirement in install_requires():
        assert requirement.specifier.contains(oldest[canonicalize_name(requirement.name)]), str(requirement)


def test_the_oldest_python_admitted_runs_every_installed_dependency():
    """python_requires was >=3.10 while TRL 1.16 needs 3.11: pip on 3.10 failed with a resolver conflict naming
    trl instead of saying which Python the package needs."""
    (floor,) = [s.version for s in SpecifierSet(setup_argument("python_requires")) if s.operator == ">="]
    for requirement in install_requires():
        needs = metadata(requirement.name).get("Requires-Python")
        if needs:
            assert SpecifierSet(needs).contains(floor), f"{requirement.name} requires Python {needs}"


def imported_distributions() -> dict[str, str]:
    """The distribution of every third-party module the package imports (at any depth, optional ones included), by
    canonical name, with the module that names it."""
    installed = packages_distributions()
    found = {}
    for path in (ROOT / "trl_diffusion").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "trl_diffusion":
                    continue
                for distribution in installed.get(top, [top]):  # not installed (an optional extra): its own name
                    found[canonicalize_name(distribution)] = top
    return found


def test_every_imported_distribution_is_declared():
    """numpy, sympy, pyarrow, tqdm, packaging and huggingface_hub were imported without being declared: they came
    with transformers, datasets or math-verify, at whatever version those happened to need."""
    declared = {canonicalize_name(r.name) for r in install_requires()}
    for extra in setup_argument("extras_require").values():
        declared |= {canonicalize_name(Requirement(text).name) for text in extra}
    imported = imported_distributions()
    assert {"numpy", "torch", "deepspeed"} <= imported.keys()  # the walk sees nested and optional imports
    assert sorted(f"{name} (import {module})" for name, module in imported.items() if name not in declared) == []
