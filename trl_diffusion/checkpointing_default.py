"""TRL's "gradient checkpointing on by default" without transformers' deprecation warning on every config.

transformers 5.24 renamed ``gradient_checkpointing`` to ``activation_checkpointing`` and warns (FutureWarning)
whenever the old name is set, which TRL's configs do by default (True). Our configs inherit this mixin first: where
transformers has the new name, both names default to None and ``__post_init__`` turns checkpointing on when
neither was given, so a default config warns about nothing. An explicit value under either name works as in
transformers (the old one still warns; both names read the resolved value afterwards). On older transformers the
mixin adds nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

HAS_ACTIVATION_CHECKPOINTING = "activation_checkpointing" in TrainingArguments.__dataclass_fields__

if HAS_ACTIVATION_CHECKPOINTING:

    @dataclass
    class CheckpointingDefault:
        gradient_checkpointing: bool | None = field(
            default=None,
            metadata={"help": "Deprecated alias of `activation_checkpointing` (transformers >= 5.24)."},
        )
        activation_checkpointing: bool | None = field(
            default=None,
            metadata={"help": "Checkpoint activations to trade compute for memory (about 20% slower training). "
                      "Default: on, as in TRL's configs."},
        )

        def __post_init__(self):
            if self.activation_checkpointing is None and self.gradient_checkpointing is None:
                self.activation_checkpointing = True
            super().__post_init__()

else:

    @dataclass
    class CheckpointingDefault:
        pass
