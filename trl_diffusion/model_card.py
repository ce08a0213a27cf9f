"""Model cards: TRL's card (``create_model_card``), with a quick start that runs for a diffusion model and the
trl_diffusion version among the framework versions.

TRL's quick start loads the model with a bare ``transformers.pipeline``, which fails on an SDAR / LLaDA / Dream
checkpoint ("model type `sdar` ... not recognize[d]") unless ``import trl_diffusion`` registered the classes first,
and it cannot load a value model at all. TRL's card also names a base model that is no Hub id (a local folder, the
embedded tiny model) as ``[None](https://huggingface.co/None)``, and PEFT's ``save_pretrained`` leaves its own empty
template (and the local base model's absolute path) in an adapter's folder.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path

QUICK_START = re.compile(r"(## Quick start\n\n```python\n).*?(```)", re.S)
FRAMEWORK_VERSIONS = "### Framework versions\n\n"
REGISTER = "import trl_diffusion  # registers the SDAR / LLaDA / Dream model classes with transformers\n"
NO_BASE_MODEL = "This model is a fine-tuned version of [None](https://huggingface.co/None)"
"""TRL's sentence where its ``base_model`` is None: a base model that is a local folder, or has no name."""
EMBEDDED_PROMPT = "What is 123+456?\n"
"""A prompt in the embedded model's format (``assets.EMBEDDED_FORMAT``: plain, no chat template)."""
EMBEDDED_NEW_TOKENS = 16
"""Its answers (``\\boxed{579}``) take under 16 tokens, and it has 128 positions in all: TRL's 128 new tokens fail."""
QUESTION = ("If you had a time machine, but could only go to the past or the future once and never return, which "
            "would you choose and why?")
OURS = "- trl_diffusion: "
"""The line our card adds (its framework versions): a card without it is another library's."""


def card_dataset_name(dataset_name: str | None) -> str | None:
    """The dataset a card may name: a Hub id as given, and None for a local file or folder (a card names it in its
    metadata and links it as ``huggingface.co/datasets/<name>``: a pushed card published the absolute local path)."""
    if dataset_name is None:
        return None
    path = os.path.expanduser(str(dataset_name))
    return None if os.path.isabs(path) or os.path.exists(path) else dataset_name


def is_local_path(name: str | None) -> bool:
    """``name`` is a local file or folder (an absolute path, or one that exists), not a Hub id."""
    path = os.path.expanduser(str(name or ""))
    return bool(name) and (os.path.isabs(path) or os.path.exists(path))


def base_model_sentence(name_or_path: str | None) -> str:
    """What replaces :data:`NO_BASE_MODEL`: the embedded model by its name, another local folder by its folder name
    (no huggingface.co link, no path of this machine), a model with no name as such."""
    from .assets import EMBEDDED_MODEL, is_embedded_model

    if not name_or_path:
        return "This model was fine-tuned from a model that was not loaded from a saved checkpoint"
    path = Path(os.path.expanduser(str(name_or_path))).resolve()
    embedded = (f"`{EMBEDDED_MODEL.name}`, the tiny SDAR model shipped with trl_diffusion "
                "(`trl_diffusion.assets.EMBEDDED_MODEL`)")
    if path == EMBEDDED_MODEL.resolve():
        return f"This model is a fine-tuned version of {embedded}"
    lineage = f", itself trained from {embedded}" if is_embedded_model(path) else ""
    return f"This model is a fine-tuned version of a local model (`{path.name}`){lineage}"


def quick_start_prompt(trainer) -> str | None:
    """The prompt the policy's quick start passes: None (chat messages) for a model that chats; the embedded task's
    plain prompt for the embedded model or one trained from it (trained on plain prompts, it answers chat messages
    with an empty string); a plain question for a tokenizer without a chat template (the pipeline refuses messages)."""
    from .assets import is_embedded_model

    if is_embedded_model(trainer.model.config):
        return EMBEDDED_PROMPT
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    return None if getattr(tokenizer, "chat_template", None) else QUESTION


def policy_quick_start(model_id: str | None, generate_kwargs: dict, in_generation_config: bool = False,
                       trainer=None) -> str:
    """Chat with the trained policy through ``pipeline``; ``generate_kwargs``: sampler arguments for ``generate()``
    (e.g. the rollout settings a TraceRL policy was trained with). ``in_generation_config``: the saved
    ``generation_config.json`` already holds them, so the code names them in a comment instead of passing them.
    ``trainer``: the policy's, which picks a plain prompt over chat messages (:func:`quick_start_prompt`)."""
    prompt = quick_start_prompt(trainer) if trainer is not None else None
    if prompt == EMBEDDED_PROMPT and "max_new_tokens" in generate_kwargs:
        generate_kwargs = {**generate_kwargs, "max_new_tokens": min(generate_kwargs["max_new_tokens"],
                                                                     EMBEDDED_NEW_TOKENS)}
    settings = ", ".join(f"{name}={value!r}" for name, value in generate_kwargs.items())
    arguments, note = "".join(f"{name}={value!r}, " for name, value in generate_kwargs.items()), ""
    if in_generation_config:
        text = (f"generation_config.json holds the sampler the policy was trained with ({settings}); arguments "
                "passed here win over it")
        arguments, note = "", "".join(f"# {line}\n" for line in textwrap.wrap(text, 116, break_on_hyphens=False))
    question, ask = f"question = {json.dumps(QUESTION)}\n", '[{"role": "user", "content": question}]'
    if prompt is not None:  # a plain prompt
        question, ask = f"prompt = {json.dumps(prompt)}\n", "prompt"
    return (
        f"{REGISTER}from transformers import pipeline\n\n"
        f"{question}"
        f'generator = pipeline("text-generation", model="{model_id}", device_map="auto")\n'
        f"{note}"
        f"output = generator({ask}, {arguments}return_full_text=False)[0]\n"
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
    """Rewrite the card TRL's ``create_model_card`` just wrote in ``trainer.args.output_dir``: our quick start, the
    trl_diffusion version, and the base model named without a broken link (:func:`base_model_sentence`). Main process
    only, as TRL writes it."""
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
        text = text.replace(FRAMEWORK_VERSIONS, f"{FRAMEWORK_VERSIONS}{OURS}{__version__}\n", 1)
    if NO_BASE_MODEL in text:
        name = getattr(getattr(trainer.model, "config", None), "_name_or_path", None)
        text = text.replace(NO_BASE_MODEL, base_model_sentence(name), 1)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def finish_adapter_card(trainer, folder: str) -> None:
    """After a PEFT adapter's save into ``folder``: PEFT's ``save_pretrained`` wrote its card there (its empty template
    where there was none) with ``base_model``: the base model's name, an absolute path of this machine for a local
    one. In ``output_dir`` its template gives way to our card (PEFT's metadata added again, as PEFT adds it to an
    existing card); in any folder a local base model's path leaves the card (``adapter_config.json`` keeps it: PEFT
    loads the base model from there). Call it on the process that saves."""
    from huggingface_hub import ModelCard

    path = os.path.join(folder, "README.md")
    if not (os.path.exists(os.path.join(folder, "adapter_config.json")) and os.path.exists(path)):
        return
    model = trainer.model
    with open(path, encoding="utf-8") as handle:
        ours = OURS in handle.read()
    if not ours and os.path.abspath(folder) == os.path.abspath(trainer.args.output_dir) and hasattr(
            model, "create_or_update_model_card"):
        hub_model_id = trainer.args.hub_model_id
        trainer.create_model_card(model_name=hub_model_id.split("/")[-1] if hub_model_id else Path(folder).name)
        model.create_or_update_model_card(folder)
    card = ModelCard.load(path)
    base = card.data.get("base_model")
    if isinstance(base, str) and is_local_path(base):
        card.data.base_model = None
        card.data.tags = [tag for tag in card.data.tags or [] if tag != f"base_model:adapter:{base}"] or None
        card.save(path)
