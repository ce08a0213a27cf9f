"""The training scripts, installed with the package (as TRL's ``trl/scripts``): ``sft``, ``math`` and ``code``. Run one
with ``trl-diffusion <name>`` (through ``accelerate launch``), ``accelerate launch -m trl_diffusion.scripts.<name>``
or, from a checkout, ``accelerate launch examples/<name>.py``."""
