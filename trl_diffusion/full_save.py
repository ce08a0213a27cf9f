"""A final ``save_model`` that writes a loadable model under FSDP's sharded state dict.

Under FSDP with ``fsdp_state_dict_type: SHARDED_STATE_DICT`` (FSDP2's default in accelerate, and what
``examples/accelerate_configs/fsdp2.yaml`` and TRL's own ``fsdp2.yaml`` use), transformers' ``Trainer.save_model``
writes nothing: the sharded weights only go into checkpoints (``pytorch_model_fsdp_0/``, written with the
optimizer), and ``config.json`` and the weights of the trained model never reach ``output_dir`` or the Hub
(huggingface/transformers#30491, #37519). The trainers here save such a model whole, as accelerate recommends
("train sharded, save full"): the full weights are gathered on every process (a collective, as transformers does
for ``FULL_STATE_DICT``) and written by the one that saves. Checkpoints keep their sharded files.
"""

from __future__ import annotations

from collections.abc import Callable


def sharded_fsdp(trainer) -> bool:
    """Whether ``trainer`` runs under FSDP with a state dict type other than ``FULL_STATE_DICT``."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return False
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return plugin is not None and "FULL_STATE_DICT" not in str(plugin.state_dict_type)


def save_model_whole(trainer, output_dir: str | None, internal_call: bool,
                     save_model: Callable[[str | None, bool], None]) -> None:
    """``save_model`` (transformers'), except that under sharded FSDP a save outside a checkpoint gathers the full
    weights and writes them with ``config.json`` (``trainer._save``), then pushes as transformers would.

    A checkpoint's save is the one transformers' ``_save_checkpoint`` makes: ``_internal_call=True`` with the
    checkpoint's folder; accelerate writes the sharded weights there, so it is left as it is. Every other save (the
    user's ``save_model(...)``, ``push_to_hub()``'s ``save_model(_internal_call=True)`` into ``output_dir``) is whole.
    """
    checkpoint = internal_call and output_dir is not None
    if checkpoint or not sharded_fsdp(trainer):
        save_model(output_dir, internal_call)
        return
    state_dict = trainer.accelerator.get_state_dict(trainer.model)  # every process: a collective under FSDP
    trainer._save(output_dir or trainer.args.output_dir, state_dict=state_dict)
    if trainer.args.push_to_hub and not internal_call:
        trainer.push_to_hub(commit_message="Model save", revision=trainer.args.hub_revision)
