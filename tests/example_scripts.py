"""Load ``examples/<name>.py`` as a module (its ``main`` and ``make_parser``), for tests that parse its flags or run
it in the test process as its ``__main__`` does (``trl_diffusion.cli.run_script(main, make_parser(), argv)``)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
