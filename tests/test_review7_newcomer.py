"""A newcomer walking README -> docs -> examples -> ``trl-diffusion eval``: the mistakes such a user makes stop
early with one line that names the problem and the fix (``--max_steps 0``, ``--device cuda`` on a CPU machine, a
Hub id while offline, a mistyped flag), ``--help`` says what each flag does, and every link between the docs
pages resolves."""

from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from test_cli import load_example, one_line_error

from trl_diffusion import DiffusionSFTConfig, TraceRLConfig
from trl_diffusion.assets import check_hub_model_cached
from trl_diffusion.cli import main
from trl_diffusion.command_line import explain_unknown_flags
from trl_diffusion.eval import evaluate
from trl_diffusion.eval.evaluate import PLAIN_PROMPT_HINT
from trl_diffusion.scripts.utils import parse_script_args
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.value import DiffusionValueConfig

ROOT = Path(__file__).resolve().parent.parent
CPU = dict(bf16=False, use_cpu=True, report_to="none")
MISSING = "nobody-review7/not-a-model"
evaluate_module = importlib.import_module("trl_diffusion.eval.evaluate")  # the package exports a function of that name


@pytest.mark.parametrize("config", [TraceRLConfig, DiffusionSFTConfig, DiffusionValueConfig])
def test_max_steps_zero_is_refused(config):
    """transformers' Trainer reads ``max_steps=0`` as a step budget it checks only after a step: the run trained one
    step and saved the model. Now the config refuses it; -1 (epochs) and positive values are unchanged."""
    with pytest.raises(ValueError, match=r"max_steps=0 would still run one optimizer step.*-1 to train for"):
        config("unused", max_steps=0, **CPU)
    assert config("unused", max_steps=-1, **CPU).max_steps == -1
    assert config("unused", max_steps=3, **CPU).max_steps == 3


def test_example_max_steps_zero_is_one_line(capsys):
    parser = load_example("sft").make_parser()
    with pytest.raises(SystemExit) as exit_info:
        parse_script_args(parser, ["--max_steps", "0"])
    assert exit_info.value.code == 2
    assert "max_steps=0" in one_line_error(capsys, parser.prog)


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if evaluation gets as far as loading its problems or the model."""

    def loaded(*args, **kwargs):
        raise AssertionError("loaded before the argument was checked")

    monkeypatch.setattr(evaluate_module, "_problems", loaded)
    monkeypatch.setattr(evaluate_module, "load_model_and_tokenizer", loaded)


def test_eval_cuda_device_without_cuda_fails_first(monkeypatch, no_loading, capsys):
    """``--device cuda`` on a machine without CUDA was a traceback from inside torch ("Torch not compiled with CUDA
    enabled") after the dataset had loaded; now one line naming the device and the fix, before anything loads."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match=r"device 'cuda': CUDA is not available here.*--device cpu"):
        evaluate(device="cuda", output_dir="", progress=False)
    assert main(["eval", "--device", "cuda:0", "--output_dir", ""]) == 2
    assert "CUDA is not available" in one_line_error(capsys, "trl-diffusion eval")


def test_eval_cuda_index_beyond_the_visible_devices(monkeypatch, no_loading):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"device 'cuda:3': only 1 CUDA device"):
        evaluate(device="cuda:3", output_dir="", progress=False)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """The Hub offline, with an empty cache but for one cached model, ``owner/cached``."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--owner--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / "models--owner--cached" / "refs").mkdir()
    (cache / "models--owner--cached" / "refs" / "main").write_text("abc123")
    tokenizer_only = cache / "models--owner--tokenizer-only"  # a tokenizer repository: no config.json
    (tokenizer_only / "snapshots" / "def456").mkdir(parents=True)
    (tokenizer_only / "snapshots" / "def456" / "tokenizer_config.json").write_text("{}")
    (tokenizer_only / "refs").mkdir()
    (tokenizer_only / "refs" / "main").write_text("def456")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


def test_offline_hub_id_not_in_the_cache_names_it(offline, tmp_path):
    """transformers' own message ("We couldn't connect to 'https://huggingface.co' ...") names neither the model
    nor the fix, and the examples printed it as a traceback after the dataset was built."""
    with pytest.raises(ValueError, match=rf"model '{MISSING}' is not in the local Hugging Face cache.*"
                                         rf"`hf download {MISSING}`"):
        check_hub_model_cached(MISSING)
    with pytest.raises(ValueError, match=r"at revision 'v2'.*--revision v2"):
        check_hub_model_cached(MISSING, revision="v2")
    check_hub_model_cached("owner/cached")  # in the cache
    check_hub_model_cached("owner/tokenizer-only", file_name="tokenizer_config.json")  # found by its own file
    with pytest.raises(ValueError, match="owner/tokenizer-only"):
        check_hub_model_cached("owner/tokenizer-only")
    check_hub_model_cached(str(tmp_path))  # a local directory


def test_online_hub_id_is_not_checked(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    check_hub_model_cached(MISSING)  # left to the download


def test_offline_hub_id_is_one_line_in_eval_and_examples(offline, no_loading, capsys):
    assert main(["eval", "--model_name_or_path", MISSING]) == 2
    assert f"model '{MISSING}' is not in the local Hugging Face cache" in one_line_error(capsys, "trl-diffusion eval")
    assert main(["eval", "--tokenizer_name_or_path", MISSING, "--model_name_or_path", "owner/cached"]) == 2
    assert MISSING in one_line_error(capsys, "trl-diffusion eval")
    with pytest.raises(AssertionError, match="loaded before"):  # a cached tokenizer repository passes the check
        main(["eval", "--tokenizer_name_or_path", "owner/tokenizer-only", "--model_name_or_path", "owner/cached"])
    parser = load_example("math").make_parser()
    with pytest.raises(SystemExit) as exit_info:
        parse_script_args(parser, ["--model_name_or_path", MISSING])
    assert exit_info.value.code == 2
    assert "hf download" in one_line_error(capsys, parser.prog)


def test_a_mistyped_flag_is_named_with_the_closest_real_one(no_loading, capsys):
    """Before: ``Some specified arguments are not used by the HfArgumentParser: ['--max_problms', '10']``."""
    assert main(["eval", "--max_problms", "10", "--tempreature=0.5", "--zzz", "1"]) == 2
    line = one_line_error(capsys, "trl-diffusion eval")
    assert ("unknown argument(s): --max_problms (did you mean --max_problems?), --tempreature=0.5 (did you mean "
            "--temperature?), --zzz;") in line
    parser = load_example("math").make_parser()
    with pytest.raises(SystemExit):
        parse_script_args(parser, ["--max_stepz", "2"])
    assert "--max_stepz (did you mean --max_steps?)" in one_line_error(capsys, parser.prog)
    assert explain_unknown_flags(None, "max_problems must be positive") == "max_problems must be positive"


def test_help_states_each_default_once_and_describes_the_no_switches(capsys):
    """Before: ``Model path or Hub id (default: the embedded tiny model). (default: None)`` and ``--no_progress:
    Show a progress bar. (default: False)``."""
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: the embedded tiny model). (default: None)" not in text
    assert "Model path or Hub id (default: the embedded tiny model)." in text
    assert "--no_progress, --no-progress Same as --progress false." in text
    assert "while the model loads. (default: True)" in text  # a default the help does not state is still shown


DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file (lower case, punctuation dropped, spaces to dashes, repeats
    numbered)."""
    anchors, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        fenced ^= line.startswith("```")
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        base = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        anchor, n = base, 0
        while anchor in anchors:
            n += 1
            anchor = f"{base}-{n}"
        anchors.add(anchor)
    return anchors


def _links(path: Path) -> list[tuple[int, str]]:
    found, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fenced ^= line.startswith("```")
        if not fenced:
            found += [(number, target) for target in LINK.findall(line) if not re.match(r"[a-z]+:", target)]
    return found


def test_anchor_rule_matches_github():
    page = ROOT / "docs" / "tracerl.md"
    assert "trls-grpoconfig-fields-under-tracerl" in _anchors(page)  # "TRL's GRPOConfig fields under TraceRL"


def test_relative_links_and_anchors_resolve():
    broken = []
    for page in DOCS:
        for number, target in _links(page):
            file, _, anchor = target.partition("#")
            linked = (page.parent / file).resolve() if file else page
            if not linked.exists():
                broken.append(f"{page.name}:{number}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.name}:{number}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve() for _, target in _links(ROOT / "README.md")}
    assert not [page.name for page in (ROOT / "docs").glob("*.md") if page.resolve() not in linked]


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """A saved model that is not the embedded one nor trained from it (random tiny weights): it never answers."""
    folder = tmp_path_factory.mktemp("other") / "model"
    tiny_model("sdar").save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


def test_eval_of_another_model_scoring_nothing_says_when_to_drop_the_chat_template(other_model, caplog):
    """Another model takes the chat template by default; when every sample scores 0 the log says that a model trained
    on plain prompts needs ``--apply_chat_template false`` (before, nothing said why)."""
    with caplog.at_level(logging.WARNING, logger=evaluate_module.__name__):
        report = evaluate(model_name_or_path=str(other_model), max_problems=4, output_dir="", progress=False,
                          max_new_tokens=8)
    assert report["apply_chat_template"] is True and report["metrics"]["accuracy"] == 0.0
    assert PLAIN_PROMPT_HINT in caplog.text and "--apply_chat_template false" in PLAIN_PROMPT_HINT


def test_no_plain_prompt_hint_when_the_template_was_chosen(other_model, caplog):
    with caplog.at_level(logging.WARNING, logger=evaluate_module.__name__):
        report = evaluate(model_name_or_path=str(other_model), max_problems=4, output_dir="", progress=False,
                          max_new_tokens=8, apply_chat_template=True)
    assert report["metrics"]["accuracy"] == 0.0 and PLAIN_PROMPT_HINT not in caplog.text


@pytest.mark.parametrize("name", ["math", "sft", "code"])
def test_an_eval_benchmark_name_is_not_a_training_set(capsys, name):
    """``--dataset_name math500`` is what ``trl-diffusion eval`` takes; an example took it for a Hub id and failed
    after the model loaded ("Couldn't reach 'math500' on the Hub"). ``gsm8k`` / ``mbpp`` stay: Hub ids with a train
    split."""
    parser = load_example(name).make_parser()
    with pytest.raises(SystemExit) as exit_info:
        parse_script_args(parser, ["--dataset_name", "math500"])
    assert exit_info.value.code == 2
    line = one_line_error(capsys, parser.prog)
    assert "'math500' is a benchmark name of `trl-diffusion eval`" in line and "leave --dataset_name unset" in line
    script_args = parse_script_args(parser, ["--dataset_name", "gsm8k", "--dataset_config", "main"])[0]
    assert (script_args.dataset_name, script_args.dataset_config) == ("gsm8k", "main")
