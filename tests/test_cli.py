"""The command line a newcomer meets first: ``trl-diffusion eval`` defaults on the embedded model, TRL's flag names,
one-line usage errors with exit status 2 (in the command and in the example scripts), and
``--resume_from_checkpoint true``."""

from __future__ import annotations

import json

import pytest
from example_scripts import load_example
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import TrlParser

from trl_diffusion.assets import EMBEDDED_MODEL, EMBEDDED_TASK, resolve_model_path
from trl_diffusion.cli import main
from trl_diffusion.command_line import UsageError
from trl_diffusion.data import evaluate_accuracy, make_problems
from trl_diffusion.eval import EvalConfig, evaluate
from trl_diffusion.scripts.utils import parse_script_args, resume_checkpoint
from trl_diffusion.testing import tiny_model


def one_line_error(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


@pytest.mark.slow
def test_eval_defaults_match_the_embedded_models_own_evaluation():
    """No arguments: plain prompts ending in a newline (the embedded model's training format), greedy, one token per
    step -- the settings its documented 37.6% was measured with (``evaluate_accuracy``, the slow obvious path)."""
    report = evaluate(max_problems=50, output_dir="", progress=False)
    assert report["apply_chat_template"] is False and report["dataset"] == "arithmetic"
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL).eval()
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    _, test = make_problems(**EMBEDDED_TASK)
    reference = evaluate_accuracy(model, tokenizer, test[:50], batch_size=50, chat_template=False)
    assert reference > 0.2  # the embedded model answers its own prompts (through the chat template: 0.0)
    assert report["metrics"]["accuracy"] == pytest.approx(reference, abs=0.04)  # 2 problems: argmax ties


def test_eval_chat_template_default_is_per_model(tmp_path):
    """The embedded model and the models trained from it (here a copy in another folder) default to plain prompts;
    any other model keeps the chat template; an explicit flag always wins."""
    from trl_diffusion.eval.evaluate import _resolve_chat_template

    assert _resolve_chat_template(EvalConfig(), None) is False
    assert _resolve_chat_template(EvalConfig(model_name_or_path=str(EMBEDDED_MODEL)), None) is False
    assert _resolve_chat_template(EvalConfig(model_name_or_path="Gen-Verse/TraDo-4B-Instruct"), None) is True
    assert _resolve_chat_template(EvalConfig(apply_chat_template=True), None) is True
    assert _resolve_chat_template(EvalConfig(model_name_or_path="x/y", apply_chat_template=False), None) is False
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL)
    assert _resolve_chat_template(EvalConfig(), model) is False  # a loaded embedded model: by its config
    model.save_pretrained(tmp_path / "copy")
    assert _resolve_chat_template(EvalConfig(), AutoModelForCausalLM.from_pretrained(tmp_path / "copy")) is False
    assert _resolve_chat_template(EvalConfig(model_name_or_path=str(tmp_path / "copy")), None) is False
    tiny_model("sdar").save_pretrained(tmp_path / "other")  # another architecture on the same tokenizer
    assert _resolve_chat_template(EvalConfig(model_name_or_path=str(tmp_path / "other")), None) is True
    assert _resolve_chat_template(EvalConfig(), tiny_model("sdar")) is True


@pytest.mark.parametrize("path", ["./my-sdar", "/tmp/does/not/exist", "~/no-such-model-dir", "a/b/c"])
def test_eval_mistyped_local_path_is_one_line_exit_2(capsys, path):
    assert main(["eval", "--model_name_or_path", path, "--progress", "false", "--output_dir", ""]) == 2
    assert one_line_error(capsys, "trl-diffusion eval").endswith(f" eval: error: no such local directory: {path}")


def test_argparse_errors_are_one_line_too(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--num_samples", "abc"])
    assert exit_info.value.code == 2 and "invalid int value: 'abc'" in one_line_error(capsys, "trl-diffusion eval")
    assert main(["eval", "--no_such_flag", "1"]) == 2
    assert "--no_such_flag" in one_line_error(capsys, "trl-diffusion eval")


def test_model_path_resolution(tmp_path):
    assert resolve_model_path(None) == str(EMBEDDED_MODEL)
    assert resolve_model_path("Gen-Verse/TraDo-4B-Instruct") == "Gen-Verse/TraDo-4B-Instruct"  # a Hub id
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    (tmp_path / "weights.bin").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        resolve_model_path(str(tmp_path / "weights.bin"))


def test_eval_takes_trls_dataset_flags_and_the_old_ones():
    parser = TrlParser(dataclass_types=[EvalConfig])
    for flags in (["--dataset_name", "gsm8k", "--dataset_test_split", "train"],
                  ["--dataset", "gsm8k", "--dataset_split", "train"]):
        (config,) = parser.parse_args_and_config(flags)
        assert (config.dataset_name, config.dataset_test_split) == ("gsm8k", "train")
    from trl_diffusion.eval.evaluate import _split_overrides

    assert _split_overrides({"dataset_split": "dev"}, None, "x.jsonl") == {"dataset_test_split": "dev",
                                                                         "dataset_name": "x.jsonl"}


def test_system_prompt_without_chat_template_is_an_error(capsys):
    flags = ["--system_prompt", "Be brief.", "--max_problems", "2", "--progress", "false", "--output_dir", ""]
    assert main(["eval", *flags, "--apply_chat_template", "false"]) == 2
    assert "system_prompt needs the chat template" in one_line_error(capsys, "trl-diffusion eval")
    assert main(["eval", *flags]) == 2  # the embedded model's default is plain prompts: the same error, explained
    assert "default for the embedded model" in one_line_error(capsys, "trl-diffusion eval")


@pytest.mark.parametrize("name", ["math", "sft", "code"])
def test_examples_reject_a_mistyped_model_path_in_one_line(capsys, name):
    parser = load_example(name).make_parser()
    with pytest.raises(SystemExit) as exit_info:
        parse_script_args(parser, ["--model_name_or_path", "./my-sdar", "--use_cpu", "true"])
    assert exit_info.value.code == 2
    assert one_line_error(capsys, parser.prog).endswith("error: no such local directory: ./my-sdar")


def test_examples_turn_config_errors_into_one_line(capsys):
    parser = load_example("math").make_parser()
    with pytest.raises(SystemExit) as exit_info:
        parse_script_args(parser, ["--remasking_strategy", "bogus", "--use_cpu", "true"])
    assert exit_info.value.code == 2 and "bogus" in one_line_error(capsys, parser.prog)


def test_resume_checkpoint_follows_transformers_convention(tmp_path):
    assert resume_checkpoint(None, str(tmp_path)) is None
    assert resume_checkpoint("false", str(tmp_path)) is None
    with pytest.raises(UsageError, match="holds no checkpoint"):
        resume_checkpoint("true", str(tmp_path))
    (tmp_path / "checkpoint-3").mkdir()
    assert resume_checkpoint("true", str(tmp_path)) is True and resume_checkpoint("True", str(tmp_path)) is True
    assert resume_checkpoint(True, str(tmp_path)) is True
    assert resume_checkpoint(str(tmp_path / "checkpoint-3"), None) == str(tmp_path / "checkpoint-3")
    with pytest.raises(UsageError, match="no such checkpoint directory"):
        resume_checkpoint(str(tmp_path / "checkpoint-9"), None)


@pytest.mark.slow
def test_example_resumes_from_the_last_checkpoint_with_true(tmp_path):
    """``--resume_from_checkpoint true`` continues the run in ``output_dir`` (transformers would look for a folder
    named "true")."""
    math = load_example("math")
    common = ["--output_dir", str(tmp_path), "--per_device_train_batch_size", "4", "--num_generations", "4",
              "--max_completion_length", "8", "--num_eval", "4", "--eval_every", "0", "--use_cpu", "true",
              "--save_strategy", "steps", "--save_steps", "1", "--logging_steps", "1"]
    first = math.main(*parse_script_args(math.make_parser(), [*common, "--max_steps", "1"]))
    saved = tmp_path / "checkpoint-1" / "trainer_state.json"
    state = json.loads(saved.read_text())
    state["log_history"].append({"step": 1, "resumed_from_here": 1.0})  # survives only if this state is loaded
    saved.write_text(json.dumps(state))
    parsed = parse_script_args(math.make_parser(), [*common, "--max_steps", "2", "--resume_from_checkpoint", "true"])
    assert parsed[1].resume_from_checkpoint is True
    resumed = math.main(*parsed)
    state = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and any("resumed_from_here" in h for h in state["log_history"])
    # the held-out curve is the whole run's: "before" is step 0's accuracy, not a measurement at the resume step
    assert [step for step, _ in resumed["accuracy_curve"]] == [0, 2]
    assert resumed["held_out_accuracy_before"] == first["held_out_accuracy_before"] == first["accuracy_curve"][0][1]


def test_eval_cuda_graphs_flag_reaches_generate():
    parser = TrlParser(dataclass_types=[EvalConfig])
    (config,) = parser.parse_args_and_config(["--cuda_graphs", "auto"])
    assert config.generate_kwargs()["cuda_graphs"] == "auto"
    (config,) = parser.parse_args_and_config([])
    assert "cuda_graphs" not in config.generate_kwargs()  # the model's generation_config, then "auto"
    with pytest.raises(SystemExit):
        parser.parse_args_and_config(["--cuda_graphs", "on"])


def test_a_mistyped_value_model_or_report_to_stops_the_script_before_it_loads(tmp_path):
    # both were only found after the policy had loaded: --value_model as a traceback (a Hub-id OSError), --report_to
    # in Trainer.__init__
    from trl_diffusion.scripts.utils import check_report_to, check_script_args

    class Args:
        model_name_or_path = None
        value_model = str(tmp_path / "my-value")
        report_to = "none"

    with pytest.raises(ValueError, match="no such local directory"):  # one line, exit 2 in a script
        check_script_args([Args()])
    Args.value_model = None
    check_script_args([Args()])
    for bad in ("wandbb", ["tensorboard", "wandbb"]):
        with pytest.raises(UsageError, match="report_to: 'wandbb' is not one of"):
            check_report_to(bad)
    for good in ("none", "all", ["tensorboard", "wandb"], None, []):
        check_report_to(good)
