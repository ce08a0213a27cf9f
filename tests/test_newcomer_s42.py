"""What a new user met in a walk through the installed wheel: a Hub dataset that cannot be loaded (a traceback per
process after the model loaded), ``--num_processes 2`` on a CPU (one process ran, alone, without a word), a recipe
given to the wrong command, unknown config keys without the closest option, an ``output_dir`` that is a file, and
``--config`` missing from ``--help``."""

from __future__ import annotations

import pytest
from test_cli import one_line_error
from test_cli_launch import launches, not_launched  # noqa: F401 (fixtures)

from trl_diffusion.cli import main
from trl_diffusion.data.loading import check_hub_dataset, load_training_dataset
from trl_diffusion.recipes import recipe_names


def run(argv: list[str]) -> int:
    """``trl-diffusion <argv>``'s exit status: what ``main`` returns, or the status a script's parsing exits with."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_a_hub_dataset_that_cannot_load_is_one_line_before_the_launch(capsys, launches):  # noqa: F811
    """The Hub is offline in the tests (conftest), so no Hub dataset is reachable: the check before the launch says
    so in one line, and the launched script's own loading does too (one line per process, not a traceback)."""
    for command in ("sft", "math", "code"):
        assert run([command, "--dataset_name", "no_such_org/no_such_set", "--max_steps", "1"]) == 2
        assert "dataset_name 'no_such_org/no_such_set': Couldn't reach" in one_line_error(
            capsys, f"trl-diffusion {command}")
    assert launches == []
    with pytest.raises(ValueError, match="dataset_name 'no_such_org/no_such_set': .* or a local .json"):
        load_training_dataset("no_such_org/no_such_set")
    check_hub_dataset("local.jsonl")  # a local file name is checked on its own (it must exist)


def test_several_processes_that_accelerate_would_start_as_one_are_refused(capsys, launches, monkeypatch,  # noqa: F811
                                                                          tmp_path):
    import accelerate.commands.config
    import torch

    no_config = tmp_path / "no_default_config.yaml"
    monkeypatch.setattr(accelerate.commands.config, "default_config_file", str(no_config))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 0)
    for command in (["sft", "--max_steps", "1"], ["eval", "--max_problems", "2", "--output_dir", ""]):
        assert run([command[0], "--num_processes", "2", *command[1:]]) == 2
        assert "--num_processes 2: accelerate launch starts one process here" in one_line_error(
            capsys, f"trl-diffusion {command[0]}")
    assert run(["sft", "--num_processes", "2", "--cpu", "--max_steps", "1"]) == 2
    assert "drop --cpu (which accelerate does not combine with --multi_gpu)" in one_line_error(capsys,
                                                                                              "trl-diffusion sft")
    assert launches == []
    assert run(["sft", "--num_processes", "1", "--max_steps", "1"]) == 0  # one process is what it asks for
    assert run(["sft", "--num_processes", "2", "--multi_gpu", "--max_steps", "1"]) == 0
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost\n")
    assert run(["sft", "--num_processes", "2", "--cpu", "--mpirun_hostfile", str(hostfile), "--max_steps", "1"]) == 0
    no_config.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")  # the machine's accelerate config decides
    assert run(["sft", "--num_processes", "2", "--max_steps", "1"]) == 0
    no_config.unlink()
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 2)  # accelerate turns multi-GPU on itself
    assert run(["sft", "--num_processes", "2", "--max_steps", "1"]) == 0
    assert len(launches) == 5


def test_a_recipe_of_another_command_is_refused_naming_its_own(capsys, launches):  # noqa: F811
    assert run(["sft", "--config", "trado_4b_tracerl_math"]) == 2
    assert one_line_error(capsys, "trl-diffusion sft").endswith(
        "--config trado_4b_tracerl_math is a recipe of trl-diffusion math (examples/math.py), not of trl-diffusion "
        "sft: run trl-diffusion math --config trado_4b_tracerl_math.")
    assert run(["math", "--config", "diffucoder_7b_coupled_code"]) == 2  # its keys fit: it would have run
    assert "run trl-diffusion code --config diffucoder_7b_coupled_code" in one_line_error(capsys, "trl-diffusion math")
    assert run(["eval", "--config", "trado_4b_tracerl_math"]) == 2
    assert "trado_4b_tracerl_math is a shipped recipe, a training configuration of trl-diffusion math" in \
        one_line_error(capsys, "trl-diffusion eval")
    assert launches == [] and len(recipe_names()) == 6


def test_unknown_config_keys_are_named_with_the_closest_option(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("learnin_rate: 1.0e-4\nmax_stepz: 3\nzzz: 1\n")
    assert run(["math", "--config", str(config)]) == 2
    assert one_line_error(capsys, "trl-diffusion math").endswith(
        "config file: unknown key(s): learnin_rate (did you mean learning_rate?), max_stepz (did you mean "
        "max_steps?), zzz; --help lists the options.")
    config.write_text("max_problem: 3\n")
    assert run(["eval", "--config", str(config)]) == 2
    assert "max_problem (did you mean max_problems?)" in one_line_error(capsys, "trl-diffusion eval")


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    existing = tmp_path / "afile"
    existing.write_text("")
    assert run(["sft", "--output_dir", str(existing)]) == 2
    assert f"output_dir {str(existing)!r} is a file, not a folder" in one_line_error(capsys, "trl-diffusion sft")


@pytest.mark.parametrize(("command", "text"), [("math", "--config FILE|RECIPE reads the options"),
                                               ("eval", "--config FILE reads the options from a YAML file")])
def test_help_says_how_to_give_a_config(command, text, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0 and text in " ".join(capsys.readouterr().out.split())


def test_refused_trl_flags_say_so_in_the_help(capsys):
    from trl_diffusion.scripts.utils import UNUSED_MODEL_FLAGS

    with pytest.raises(SystemExit):
        main(["sft", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, reason in UNUSED_MODEL_FLAGS.items():
        if f"--{flag} " in text:  # the SFT script's dataclasses lack a few of them
            assert f"Not used by these scripts (an error when set): {' '.join(reason.split())}" in text
    assert "--trust_remote_code" in text and "--load_in_4bit" in text


def test_version(capsys):
    from trl_diffusion import __version__

    assert main(["--version"]) == 0 and capsys.readouterr().out == f"trl-diffusion {__version__}\n"


def test_replay_refuses_a_mask_over_the_whole_sequence():
    """A transformers user passes the whole sequence's mask: every token was then read as prompt, and the replayed
    log-probs were off by up to 14 nats without an error."""
    import torch

    from trl_diffusion.estimators import replay_logprobs
    from trl_diffusion.testing import tiny_model

    model = tiny_model("sdar")
    ids = torch.tensor([[20, 21, 22], [23, 24, 25]])
    out = model.generate(ids, max_new_tokens=4, block_length=4, temperature=1.0, stop_token_ids=[],
                         generator=[torch.Generator().manual_seed(i) for i in range(2)], return_dict_in_generate=True)
    prompt_mask = torch.ones_like(ids)
    replayed = replay_logprobs(model, out.sequences, prompt_mask, out.unmask_step, block_length=4)
    committed = out.unmask_step >= 0
    torch.testing.assert_close(replayed[committed], out.token_logprobs[committed], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="pass the prompt's attention mask"):
        replay_logprobs(model, out.sequences, torch.ones_like(out.sequences), out.unmask_step, block_length=4)


def test_a_reward_name_string_is_refused_naming_the_function(tmp_path):
    """TRL reads a string as a reward model's Hub id: ``reward_funcs="math_accuracy_reward"`` went to the Hub."""
    from datasets import Dataset

    from trl_diffusion import TraceRLConfig, TraceRLTrainer
    from trl_diffusion.testing import build_tokenizer, tiny_model

    args = TraceRLConfig(str(tmp_path), report_to="none", use_cpu=True, bf16=False, per_device_train_batch_size=2,
                         num_generations=2, max_completion_length=4, block_length=4)
    data = Dataset.from_list([{"prompt": "1+1"}] * 2)
    for rewards in ("math_accuracy_reward", ["math_accuracy_reward"]):
        with pytest.raises(ValueError, match="from trl_diffusion.rewards import math_accuracy_reward"):
            TraceRLTrainer(tiny_model("sdar"), rewards, args=args, train_dataset=data,
                           processing_class=build_tokenizer())


def test_a_padded_batch_without_its_attention_mask_is_warned_about(monkeypatch):
    """The embedded model's pad token is its EOS token: a left-padded batch given without its mask read the padding
    as prompt and answered differently (transformers warns there too)."""
    import torch

    from trl_diffusion.generation import mixin
    from trl_diffusion.testing import tiny_model

    left = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    assert mixin.padded_without_mask(left, 0) and mixin.padded_without_mask(left.flip(1), 0)  # left, right
    assert not mixin.padded_without_mask(torch.tensor([[0, 5, 6], [0, 7, 8]]), 0)  # a pad token that is BOS
    assert not mixin.padded_without_mask(left, None) and not mixin.padded_without_mask(left[:1], 0)
    warned = []
    monkeypatch.setattr(mixin.logger, "warning_once", warned.append)
    model = tiny_model("sdar")
    model.generation_config.pad_token_id = 0
    settings = dict(max_new_tokens=4, block_length=4, temperature=0.0, stop_token_ids=[])
    model.generate(left + 20 * (left > 0), torch.ones_like(left), **settings)
    assert warned == []
    model.generate(left + 20 * (left > 0), **settings)
    assert len(warned) == 1 and "Pass the tokenizer's attention_mask" in warned[0]
