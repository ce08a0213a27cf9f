# /// script
# dependencies = ["trl_diffusion"]
# ///
"""Diffusion SFT: ``accelerate launch examples/sft.py [--flags]``.

The script ships with the package as ``trl_diffusion/scripts/sft.py`` (its docstring says what it does with no
arguments and how to run a recipe); ``trl-diffusion sft [--flags]`` runs the same script from anywhere, through
``accelerate launch``. This file runs it from a checkout.
"""

import os
import sys

# This folder holds math.py and code.py, named like standard-library modules: drop it from the import path so that
# `python examples/<name>.py` does not import this folder's files in place of the standard library's.
if sys.path and os.path.realpath(sys.path[0]) == os.path.dirname(os.path.realpath(__file__)):
    sys.path.pop(0)

from trl_diffusion.scripts.sft import main, make_parser
from trl_diffusion.scripts.utils import run_script

if __name__ == "__main__":
    run_script(main, make_parser())
