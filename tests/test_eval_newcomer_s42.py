"""What a newcomer met with ``trl-diffusion eval``: a saved value model (TraceRL's ``<output_dir>/value_model``) given
as the model to evaluate is refused in one line naming the policy, and ``--resume`` with nothing to resume says so
(one warning) before it starts from the first sample."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

import pytest

from trl_diffusion.cli import main
from trl_diffusion.eval import evaluate
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.value import DiffusionValueModel

ev = importlib.import_module("trl_diffusion.eval.evaluate")  # the module (the package attribute is the function)
NOTHING = "nothing was found to resume in"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A TraceRL run's output_dir as the math script leaves it: the policy (with its tokenizer) and, in
    ``value_model``, the value model copied from it, each saved with ``save_pretrained``."""
    run = tmp_path_factory.mktemp("out_recipe")
    policy = tiny_model("sdar")
    policy.save_pretrained(run)
    build_tokenizer().save_pretrained(run)
    DiffusionValueModel.from_policy(policy).save_pretrained(run / "value_model")
    return run


def test_a_value_model_folder_is_refused_in_one_line_naming_the_policy(run_dir, capsys):
    value_dir = run_dir / "value_model"
    assert "DiffusionValueModel" in (value_dir / "config.json").read_text()  # as the package saves one
    for extra in ([], ["--tokenizer_name_or_path", str(run_dir)]):
        assert main(["eval", "--model_name_or_path", str(value_dir), "--progress", "false", *extra]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert err.startswith("trl-diffusion eval: error: ") and "\n" not in err, err
        assert f"{value_dir} is a value model" in err and "not a language model to evaluate" in err
        assert f"({run_dir.resolve()} holds it)" in err and "output_dir" in err
        assert "tokenizer" not in err.lower() and "keys" not in err  # not the loader's misleading errors
        assert captured.out == ""


def test_the_value_model_check_reads_only_local_value_model_folders(run_dir, tmp_path):
    ev._check_not_value_model(str(run_dir), str(run_dir))  # the policy passes
    ev._check_not_value_model("owner/name", "owner/name")  # a Hub id is not read
    alone = tmp_path / "critic"  # copied elsewhere: no policy beside it to name
    DiffusionValueModel.from_pretrained(run_dir / "value_model").save_pretrained(alone)
    with pytest.raises(ValueError, match="is a value model") as error:
        ev._check_not_value_model(str(alone), str(alone))
    assert "holds it" not in str(error.value)
    with pytest.raises(ValueError, match="is a value model"):  # evaluate() by path checks it before loading too
        evaluate(model=str(alone), dataset="arithmetic", max_problems=1, output_dir="", progress=False)


def test_resume_with_nothing_to_resume_says_so_and_starts_from_the_first_sample(tmp_path, caplog):
    out = tmp_path / "nonexistent_dir"
    settings = dict(dataset_name="arithmetic", max_problems=2, output_dir=str(out), progress=False)
    with caplog.at_level(logging.WARNING, logger=ev.logger.name):
        report = evaluate(**settings, resume=True)
    notices = [r.getMessage() for r in caplog.records if NOTHING in r.getMessage()]
    assert report["num_resumed"] == 0 and report["metrics"]["num_scored"] == 2
    assert notices == [f"--resume: {NOTHING} {out} (no {Path(report['samples_file']).name} there), so the "
                       "evaluation starts from the first sample."]

    caplog.clear()  # a finished run resumed: everything kept, no notice
    with caplog.at_level(logging.WARNING, logger=ev.logger.name):
        again = evaluate(**settings, resume=True)
    assert again["num_resumed"] == 2 and not [r for r in caplog.records if NOTHING in r.getMessage()]

    Path(report["samples_file"]).write_text("")  # its card, but no row: killed before its first batch was scored
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=ev.logger.name):
        fresh = evaluate(**settings, resume=True)
    notices = [r.getMessage() for r in caplog.records if NOTHING in r.getMessage()]
    assert fresh["num_resumed"] == 0 and len(notices) == 1 and "holds no sample of this evaluation" in notices[0]


def test_progress_false_also_hides_the_loading_bar(capsys):
    """``--progress false`` showed no evaluation bar but still transformers' "Loading weights" bar; the bars are
    enabled again afterwards."""
    from transformers.utils import logging as transformers_logging

    from trl_diffusion.eval import evaluate

    evaluate(max_problems=1, output_dir="", progress=False)
    assert "Loading weights" not in capsys.readouterr().err
    assert transformers_logging.is_progress_bar_enabled()
    evaluate(max_problems=1, output_dir="")
    assert "Loading weights" in capsys.readouterr().err
