"""Model-layer audit: released-format checkpoints written by hand (only the released config.json field names) that
must load and give the released logits."""

import json

import pytest
import torch
from numerics import assert_close_fp32
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import trl_diffusion  # noqa: F401  (registers the families)
from trl_diffusion.models import LLaDAConfig
from trl_diffusion.testing import tiny_model


def _write_llada(directory, **config_fields):
    """A tiny LLaDA checkpoint: config.json with the released field names plus ``config_fields``."""
    model = tiny_model("llada")
    config = model.config.to_dict()
    config.pop("dtype", None)
    config.update(config_fields)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    return model


def test_llada_config_with_a_tie_word_embeddings_key_loads(tmp_path):
    """transformers 4.x's ``PretrainedConfig`` kept ``tie_word_embeddings`` as a plain attribute (``True`` by default),
    so LLaDA config.json files written with ``to_dict()`` carry it; the released code ignores it (it ties by
    ``weight_tying``). It used to crash ``from_pretrained`` (the property had no setter)."""
    model = _write_llada(tmp_path, tie_word_embeddings=True)  # weight_tying False, with its ff_out head
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert loaded.config.weight_tying is False and loaded.config.tie_word_embeddings is False
    assert loaded.get_output_embeddings() is not None
    ids = torch.randint(4, 100, (1, 9))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    # the keyword form and the constructor take it too; weight_tying stays what decides
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, tie_word_embeddings=False)
    assert again.config.tie_word_embeddings is False
    assert LLaDAConfig(weight_tying=True, tie_word_embeddings=False).tie_word_embeddings is True
    loaded.save_pretrained(tmp_path / "saved")
    assert "tie_word_embeddings" not in json.loads((tmp_path / "saved" / "config.json").read_text())


@pytest.mark.parametrize("family", ["sdar", "dream", "llada"])
def test_backbone_class_loads_from_a_released_lm_checkpoint(family, tmp_path):
    """The backbone alone (``SDARModel``, what SDAR's released ``auto_map`` gives ``AutoModel``, and docs/models.md's
    advice; ``DreamBaseModel``; ``LLaDAModel``) loads from the released LM checkpoint, whose head it has no place
    for, as the releases' classes do. It used to refuse ``lm_head.weight`` as an unexpected key."""
    from trl_diffusion.models.dream import DreamBaseModel
    from trl_diffusion.models.llada import LLaDAModel
    from trl_diffusion.models.sdar import SDARModel

    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    backbone_class = {"sdar": SDARModel, "dream": DreamBaseModel, "llada": LLaDAModel}[family]
    backbone = backbone_class.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(4, 100, (1, 9))
    assert_close_fp32(backbone(ids).last_hidden_state, model.model(ids).last_hidden_state)
    # a folder holding the backbone alone still lacks the head the LM needs: an error, not a re-initialised head
    backbone.save_pretrained(tmp_path / "backbone")
    if family != "llada":  # LLaDA's head (transformer.ff_out) lives in its backbone
        with pytest.raises(ValueError, match="missing_keys"):
            AutoModelForCausalLM.from_pretrained(tmp_path / "backbone")


SLOW_BPE_STAND_IN = '''import json
from transformers import PreTrainedTokenizer


class DreamTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "vocab.json", "merges_file": "merges.txt"}

    def __init__(self, vocab_file, merges_file, **kwargs):  # the released constructor opens both files
        with open(vocab_file, encoding="utf-8") as handle:
            self.encoder = json.load(handle)
        with open(merges_file, encoding="utf-8") as handle:
            handle.read()
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self.encoder)

    def get_vocab(self):
        return dict(self.encoder)
'''


def test_saved_tokenizer_has_the_vocabulary_files_the_released_slow_tokenizer_opens(tmp_path):
    """Dream's DreamTokenizer and SDAR's Qwen2Tokenizer (the released tokenizer code the carried auto_map names) are
    slow BPE tokenizers that open vocab.json and merges.txt; transformers 5 saves tokenizer.json only, so the saved
    folder failed with trust_remote_code=True (open(None)); carry_tokenizer_code writes them from tokenizer.json."""
    from test_review2_loading import write_dream_tokenizer
    from transformers import AutoTokenizer
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from trl_diffusion.models import carry_tokenizer_code

    release = tmp_path / "release"
    release.mkdir()
    write_dream_tokenizer(release)
    (release / "tokenization_dream.py").write_text(SLOW_BPE_STAND_IN)
    tokenizer = AutoTokenizer.from_pretrained(release)
    tokenizer.save_pretrained(tmp_path / "saved")
    carry_tokenizer_code(tmp_path / "saved", tokenizer)
    saved = tmp_path / "saved"
    assert json.loads((saved / "vocab.json").read_text()) == json.loads((release / "vocab.json").read_text())
    for name in ("merges.txt", "tokenization_dream.py"):
        assert (saved / name).read_text().strip() == (release / name).read_text().strip(), name
    released_class = get_class_from_dynamic_module("tokenization_dream.DreamTokenizer", saved)
    released = released_class.from_pretrained(saved)  # what trust_remote_code=True runs without trl_diffusion
    assert released.convert_tokens_to_ids("<|mask|>") == tokenizer.mask_token_id


def test_ignore_mismatched_sizes_reinitialises_instead_of_raising(tmp_path):
    """A different vocabulary: an error by default (a re-initialised weight would be silent), re-initialised
    weights when the caller asks for them with ``ignore_mismatched_sizes=True``, as in transformers."""
    from trl_diffusion.models import SDARForCausalLM
    from trl_diffusion.testing import tiny_model

    model = tiny_model("sdar")
    model.save_pretrained(tmp_path)
    wider = model.config.vocab_size + 8
    with pytest.raises((ValueError, RuntimeError), match="mismatched|ignore_mismatched_sizes"):
        SDARForCausalLM.from_pretrained(tmp_path, vocab_size=wider)
    loaded = SDARForCausalLM.from_pretrained(tmp_path, vocab_size=wider, ignore_mismatched_sizes=True)
    assert loaded.get_input_embeddings().weight.shape[0] == wider
    kept = loaded.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(kept, model.model.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_set_output_embeddings_takes_transformers_keyword(family):
    # transformers names the parameter new_embeddings; ours was `value`, a TypeError by keyword
    model = tiny_model(family, **({"weight_tying": False} if family == "llada" else {}))
    head = torch.nn.Linear(model.config.hidden_size if family != "llada" else model.config.d_model,
                           model.get_output_embeddings().out_features, bias=False)
    model.set_output_embeddings(new_embeddings=head)
    assert model.get_output_embeddings() is head
