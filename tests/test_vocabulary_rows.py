"""Token ids against the rows of the model's input embedding (``trl_diffusion/vocabulary.py``): ids outside them
failed with a bare IndexError inside the embedding, at the first step (a device-side assert on CUDA), and PEFT's
``trainable_token_indices`` wrapper (no ``num_embeddings``) made ``generate()`` and TraceRL fail outright."""

import peft
import pytest
import torch
from datasets import Dataset, IterableDataset

from trl_diffusion import DiffusionValueModel
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer, TraceRLConfig, TraceRLTrainer
from trl_diffusion.vocabulary import embedding_rows

PAIRS = [{"prompt": "What is 12+7?\n", "completion": "zz{19}"}, {"prompt": "Hi!\n", "completion": "zz{-3}"}]


def sft_config(tmp_path, **kw):
    return DiffusionSFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False, gradient_checkpointing=False,
                              save_strategy="no", use_cpu=True, max_length=64, disable_tqdm=True,
                              per_device_train_batch_size=2, max_steps=1, **kw)


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_generate_reads_the_rows_through_peft_trainable_tokens(family):
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>"]})
    model = tiny_model(family)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    new, rows = tokenizer.convert_tokens_to_ids("<think>"), model.get_input_embeddings().num_embeddings
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[new])
    wrapped = peft.get_peft_model(model, config)
    assert not hasattr(wrapped.get_input_embeddings(), "num_embeddings")
    assert embedding_rows(wrapped) == rows
    out = wrapped.generate(torch.tensor([[5, 6, new]]), max_new_tokens=4, block_length=4)
    assert out.shape[0] == 1 and out.shape[1] >= 3 + 4
    with pytest.raises(ValueError, match=rf"input_ids holds token ids outside \[0, {rows}\)"):
        wrapped.generate(torch.tensor([[5, 6, rows]]), max_new_tokens=4, block_length=4)


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
@pytest.mark.parametrize("mask_id", [-1, 200])
def test_a_mask_id_that_is_no_embedding_row_is_refused_by_generate(family, mask_id):
    model = tiny_model(family)
    model.config.mask_token_id = mask_id
    with pytest.raises(ValueError, match=rf"mask_token_id {mask_id} is no row of its input embedding \(\[0, 128\)\)"):
        model.generate(torch.tensor([[5, 6]]), max_new_tokens=4, block_length=4)


def test_a_mask_token_added_without_resizing_is_refused_by_the_trainers(tmp_path):
    # the realistic case: a new mask token added to the tokenizer, the model's embedding not resized
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"mask_token": "<|NEWMASK|>"})
    model = tiny_model("sdar", vocab_size=101)
    model.config.mask_token_id = tokenizer.mask_token_id  # 101: one past the model's rows
    with pytest.raises(ValueError, match=r"mask_token_id 101 is no row .*resize_token_embeddings"):
        DiffusionSFTTrainer(model, args=sft_config(tmp_path), train_dataset=Dataset.from_list(PAIRS),
                            processing_class=tokenizer)
    with pytest.raises(ValueError, match=r"mask_token_id 101 is no row"):
        TraceRLTrainer(model, lambda completions, **_: [0.0] * len(completions),
                       args=TraceRLConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False,
                                          per_device_train_batch_size=2, num_generations=2, max_completion_length=8,
                                          block_length=4),
                       train_dataset=Dataset.from_dict({"prompt": ["ab", "cd"]}), processing_class=tokenizer)


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_sft_refuses_data_with_ids_beyond_the_models_rows(tmp_path, family):
    tokenizer = build_tokenizer()  # 101 tokens
    model = tiny_model(family, vocab_size=64, **({"embedding_size": 64} if family == "llada" else {}))
    assert embedding_rows(model) == 64
    with pytest.raises(ValueError, match=r"2 row\(s\) of the prepared train dataset \(0, 1\): token ids outside "
                                         r"\[0, 64\).*resize_token_embeddings"):
        DiffusionSFTTrainer(model, args=sft_config(tmp_path), train_dataset=Dataset.from_list(PAIRS),
                            processing_class=tokenizer)
    stream = IterableDataset.from_generator(lambda: iter(PAIRS))  # first seen by the collator
    trainer = DiffusionSFTTrainer(model, args=sft_config(tmp_path), train_dataset=stream, processing_class=tokenizer)
    with pytest.raises(ValueError, match=r"sample_index \d of a batch: token ids outside \[0, 64\)"):
        trainer.train()


def test_tracerl_refuses_a_value_model_with_fewer_rows_than_the_policy(tmp_path):
    # the policy samples any of its 128 rows; a 110-row value model failed with an IndexError at its first forward
    policy = tiny_model("sdar")
    value = DiffusionValueModel.from_policy(tiny_model("sdar", vocab_size=110))
    with pytest.raises(ValueError, match=r"value model's embedding has 110 rows, fewer than the policy's \(128\)"):
        TraceRLTrainer(policy, lambda completions, **_: [0.0] * len(completions), value_model=value,
                       args=TraceRLConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False,
                                          per_device_train_batch_size=2, num_generations=2, max_completion_length=8,
                                          block_length=4),
                       train_dataset=Dataset.from_dict({"prompt": ["ab", "cd"]}), processing_class=build_tokenizer())


def test_sft_names_the_sample_of_an_id_beyond_the_rows_in_a_packed_row(tmp_path):
    # the packed row's first sample was named, whichever document held the id
    rows = [{"prompt": "ab", "completion": "cd"}, {"prompt": "ef", "completion": "gh"},
            {"prompt": "ij", "completion": "k?"}, {"prompt": "mn", "completion": "op"}]  # '?': an id >= 64
    stream = IterableDataset.from_generator(lambda: iter(rows))
    trainer = DiffusionSFTTrainer(tiny_model("sdar", vocab_size=64), args=sft_config(tmp_path, packing=True),
                                  train_dataset=stream, processing_class=build_tokenizer())
    with pytest.raises(ValueError, match=r"sample_index 2 of a batch: token ids outside \[0, 64\)"):
        trainer.train()
