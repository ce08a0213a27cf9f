"""The helper scripts honour the flags their docstrings promise, and refuse the ones they set themselves."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv", [["--max_steps", "5"], ["--max-steps=5"], ["--max_step", "5"],
                                  ["--likelihood_estimator", "coupled"], ["--config", "CONFIG"]])
def test_tracerl_arithmetic_refuses_the_fields_it_sets_per_run(argv, tmp_path):
    """Before, ``--max_steps`` and ``--likelihood_estimator`` were parsed and then overwritten by ``--max_rollouts``
    and ``--estimators`` without a word; any spelling of them (a prefix, dashes, a config file) is refused."""
    script = _load("tracerl_arithmetic")
    config = tmp_path / "config.yaml"
    config.write_text("likelihood_estimator: coupled\n")
    argv = [str(config) if arg == "CONFIG" else arg for arg in argv]
    _, args = script.make_parser().parse_args_and_config(argv)
    with pytest.raises(ValueError, match="set by this script for each run; pass --"):
        script.refuse_fields_set_per_run(args)
    _, args = script.make_parser().parse_args_and_config(["--max_rollouts", "3", "--estimators", "coupled"])
    script.refuse_fields_set_per_run(args)


def test_train_arithmetic_keeps_a_given_max_length(tmp_path):
    """Before, the EOS canvas replaced ``--max_length`` whatever the command line said; now it is only the default."""
    script = _load("train_arithmetic")
    common = ["--num_train", "32", "--num_test", "4", "--hidden_size", "16", "--num_layers", "1", "--max_steps", "1",
              "--per_device_train_batch_size", "4", "--eval_batch_size", "4", "--logging_steps", "1"]
    lengths = {}
    for given in ([], ["--max_length", "40"]):
        script_args, args = script.parse_arguments(script.make_parser(),
                                                   common + given + ["--output_dir", str(tmp_path / str(len(given)))])
        script.main(script_args, args)
        assert args.pad_to_length_with_eos
        lengths[bool(given)] = args.max_length
    assert lengths[True] == 40
    assert lengths[False] == script.canvas_length(script_args, 0) < 40
    # flags are validated as usual: EOS padding and packing exclude each other (it trained with both before)
    with pytest.raises(ValueError, match="pad_to_length_with_eos"):
        script.parse_arguments(script.make_parser(), common + ["--packing", "True"])
    script_args, args = script.parse_arguments(script.make_parser(), common + ["--pad_to_length_with_eos", "False"])
    assert not args.pad_to_length_with_eos
