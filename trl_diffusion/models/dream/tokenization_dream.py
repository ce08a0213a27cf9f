"""DreamTokenizer: the tokenizer class named by Dream's and DiffuCoder's released ``tokenizer_config.json``."""

from __future__ import annotations

from transformers import Qwen2Tokenizer


class DreamTokenizer(Qwen2Tokenizer):
    """transformers' Qwen2 byte-level BPE tokenizer under the released name. The release's ``DreamTokenizer`` is a
    renamed copy of the Qwen2 tokenizer (``vocab.json`` + ``merges.txt``), shipped as remote code; registering
    this class for ``DreamConfig`` lets ``AutoTokenizer.from_pretrained`` load the released files without
    ``trust_remote_code``."""
