"""Model cards: TRL's card (``create_model_card``), with a quick start that runs for a diffusion model and the
trl_diffusion version among the framework versions.

TRL's quick start loads the model with a bare ``transformers.pipeline``, which fails on an SDAR / LLaDA / Dream
checkpoint ("model type `sdar` ... not recognize[d]") unless ``import trl_diffusion`` registered the classes first,
and it cannot load a value model at all.
"""

from __future__ import annotations

import os
import re
import textwrap

QUICK_START = re.compile(r"(## Quick start\n\n```python\n).*?(```)", re.S)
FRAMEWORK_VERSIONS = "### Framework versions\n\n"
REGISTER = "import trl_diffusion  # registers the SDAR / LLaDA / Dream model classes with transformers\n"


def card_dataset_name(dataset_name: str | None) -> str | None:
    """The dataset a card may name: a Hub id as given, and None for a local file or folder (a card names it in its
    metadata and links it as ``huggingface.co/datasets/<name>``: a pushed card published the absolute local path)."""
    if dataset_name is None:
        return None
    path = os.path.expanduser(str(dataset_name))
    return None if os.path.isabs(path) or os.path.exists(path) else dataset_name


def policy_quick_start(model_id: str | None, generate_kwargs: dict, in_generation_config: bool = False) -> str:
    """Chat with the trained policy through ``pipeline``; ``generate_kwargs``: sampler arguments for ``generate()``
    (e.g. the rollout settings a TraceRL policy was trained with). ``in_generation_config``: the saved
    ``generation_config.json`` already holds them, so the code names them in a comment instead of passing them."""
    settings = ", ".join(f"{name}={value!r}" for name, value in generate_kwargs.items())
    arguments, note = "".join(f"{name}={value!r}, " for name, value in generate_kwargs.items()), ""
    if in_generation_config:
        text = (f"generation_config.json holds the sampler the policy was trained with ({settings}); arguments "
                "passed here win over it")
        arguments, note = "", "".join(f"# {line}\n" for line in textwrap.wrap(text, 116, break_on_hyphens=False))
    return (
        f"{REGISTER}from transformers import pipeline\n\n"
        'question = "If you had a time machine, but could only go to the past or the future once and never return, '
        'which would you choose and why?"\n'
        f'generator = pipeline("text-generation", model="{model_id}", device_map="auto")\n'
        f"{note}"
        f'output = generator([{{"role": "user", "content": question}}], {arguments}return_full_text=False)[0]\n'
        'print(output["generated_text"])\n'
    )


def value_quick_start(model_id: str | None) -> str:
    """Load the trained value model (it scores trajectories; it does not generate)."""
    return (
        f"{REGISTER}from trl_diffusion.value import DiffusionValueModel\n\n"
        f'value_model = DiffusionValueModel.from_pretrained("{model_id}")\n'
        f'# or train a policy with it: TraceRLTrainer(policy, reward_funcs, args=args, value_model="{model_id}")\n'
    )


def finish_model_card(trainer, quick_start: str) -> None:
    """Rewrite the card TRL's ``create_model_card`` just wrote in ``trainer.args.output_dir``: our quick start and the
    trl_diffusion version. Main process only, as TRL writes it."""
    from . import __version__

    path = os.path.join(trainer.args.output_dir, "README.md")
    if not trainer.is_world_process_zero() or not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    text, found = QUICK_START.subn(lambda match: match.group(1) + quick_start + match.group(2), text, count=1)
    if not found:  # a TRL template without the section
        text += f"\n## Quick start\n\n```python\n{quick_start}```\n"
    if FRAMEWORK_VERSIONS in text:
        text = text.replace(FRAMEWORK_VERSIONS, f"{FRAMEWORK_VERSIONS}- trl_diffusion: {__version__}\n", 1)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
