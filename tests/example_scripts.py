"""The script ``examples/<name>.py`` runs (``trl_diffusion.scripts``,
``trl_diffusion.scripts.utils.TRAINING_SCRIPTS``): its ``main`` and ``make_parser``, for tests that parse its flags or
run it in the test process as ``examples/<name>.py`` does (``trl_diffusion.scripts.utils.run_script(main,
make_parser(), argv)``)."""

import importlib
from types import ModuleType

from trl_diffusion.scripts.utils import TRAINING_SCRIPTS


def load_example(name: str) -> ModuleType:
    return importlib.import_module(f"trl_diffusion.scripts.{TRAINING_SCRIPTS[name]}")
