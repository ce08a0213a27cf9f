"""Names written with an unknown user's home directory (``~nosuchuser/...``). ``pathlib.Path.expanduser`` raises
``RuntimeError("Could not determine home directory.")`` on them where ``os.path.expanduser`` leaves them as written;
every check that reads a model or dataset name takes such a name as the (missing) path it is written as, so a typo
in a user name is one error line, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from trl_diffusion.assets import check_hub_model_cached, check_model_folder, is_embedded_model
from trl_diffusion.cli import main
from trl_diffusion.eval.datasets import load_eval_problems
from trl_diffusion.model_card import base_model_sentence

NAME = "~nosuchuser_s45/thing"


def test_the_premise_pathlib_raises_on_an_unknown_user():
    with pytest.raises(RuntimeError):
        Path(NAME).expanduser()


def test_model_checks_take_it_as_a_missing_folder():
    assert is_embedded_model(NAME) is False
    check_model_folder(NAME)  # not a folder: nothing to refuse
    check_hub_model_cached(NAME)  # not a valid repo id: left to the loader's own message
    assert base_model_sentence(NAME).endswith("a local model (`thing`)")


def test_eval_reads_it_as_a_missing_dataset_file(capsys):
    with pytest.raises(FileNotFoundError, match="dataset file not found: ~nosuchuser_s45/thing.jsonl"):
        load_eval_problems(f"{NAME}.jsonl")
    with pytest.raises(ValueError, match="unknown dataset '~nosuchuser_s45/thing'"):
        load_eval_problems(NAME)
    assert main(["eval", "--dataset_name", f"{NAME}.jsonl", "--progress", "false"]) == 2
    error = capsys.readouterr().err
    assert "dataset file not found: ~nosuchuser_s45/thing.jsonl" in error and "Traceback" not in error
    assert main(["eval", "--model_name_or_path", NAME, "--progress", "false"]) == 2
    error = capsys.readouterr().err
    assert "no such local directory: ~nosuchuser_s45/thing" in error and "Traceback" not in error
