"""The training scripts, installed with the package (as TRL's ``trl/scripts``): ``sft``, ``tracerl_math`` and
``tracerl_code``, with what they share in :mod:`trl_diffusion.scripts.utils`. Run one with ``trl-diffusion
sft|math|code`` (through ``accelerate launch``), with ``accelerate launch -m trl_diffusion.scripts.<module>`` or by its
path, or, from a checkout, with ``accelerate launch examples/<name>.py``."""
