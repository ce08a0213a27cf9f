"""Files shipped with the package: the embedded tiny SDAR checkpoint that examples default to.

``EMBEDDED_MODEL`` is a directory loadable with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer``:
a ~0.8M-parameter SDAR (block size 4) trained from scratch with ``DiffusionSFTTrainer`` to a middling accuracy
(37.6% greedy exact match on held-out problems) on 3-digit addition and subtraction (``EMBEDDED_TASK``), a harder
variant of the 2-digit task the from-scratch proof masters, so RL has room to improve.
``scripts/make_embedded_model.py`` reproduces it from its seed.
"""

from pathlib import Path

EMBEDDED_MODEL = Path(__file__).parent / "tiny-sdar-arithmetic"
EMBEDDED_TASK = {"num_train": 12000, "num_test": 500, "digits": 3, "seed": 0}
"""``make_problems`` arguments of the task the embedded model was trained on (train split) and is scored on
(held-out split)."""
EMBEDDED_FORMAT = "prompt_completion"
"""The dataset format it was trained in: plain ``"What is a+b?\\n"`` prompts (no chat template)."""
EMBEDDED_CHAT_TEMPLATE = EMBEDDED_FORMAT == "conversational"

__all__ = ["EMBEDDED_CHAT_TEMPLATE", "EMBEDDED_FORMAT", "EMBEDDED_MODEL", "EMBEDDED_TASK"]
