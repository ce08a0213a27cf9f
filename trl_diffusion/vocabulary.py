"""The token ids a model can read: the rows of its input embedding, and its mask id checked against them.

Ids outside ``[0, rows)`` fail inside the embedding with a bare IndexError (a device-side assert on CUDA), far
from the input that held them; the sampler and the trainers check them where they first see them, through these.
"""

from __future__ import annotations


def embedding_rows(model) -> int:
    """The rows of ``model``'s input embedding: the token ids ``[0, rows)`` it can read. Read through PEFT's
    wrappers of the embedding (``trainable_token_indices``' ``TrainableTokensWrapper``, LoRA's embedding layer),
    which have no ``num_embeddings``; not from the weight, whose shape DeepSpeed ZeRO-3 partitions away."""
    embedding = model.get_input_embeddings()
    if hasattr(embedding, "original_module"):  # PEFT's TrainableTokensWrapper
        embedding = embedding.original_module
    if hasattr(embedding, "get_base_layer"):  # PEFT's tuner layers
        embedding = embedding.get_base_layer()
    return embedding.num_embeddings


def check_mask_token_id(model) -> int:
    """``model``'s mask id, refused (a ValueError) when its embedding has no such row: every forward of a masked
    position would fail with a bare IndexError inside the embedding (a device-side assert on CUDA)."""
    mask_id, rows = model.mask_token_id, embedding_rows(model)
    if not 0 <= mask_id < rows:
        raise ValueError(f"the model's mask_token_id {mask_id} is no row of its input embedding ([0, {rows})): a mask "
                         "token added to the tokenizer needs model.resize_token_embeddings(len(tokenizer)), and "
                         "config.mask_token_id must be the tokenizer's mask id.")
    return mask_id
