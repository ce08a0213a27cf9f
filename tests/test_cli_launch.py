"""The training scripts ship with the package: ``trl-diffusion sft|math|code`` runs them from anywhere through
``accelerate launch`` (as TRL's ``trl sft``), ``--config <name>`` reads a shipped recipe, and ``trl-diffusion recipes``
lists them. Before, they were repository files only: a ``pip install`` had no way to train, and the CLI's help and
warnings sent users to ``recipes/`` files they did not have. ``trl-diffusion eval`` launches the same way when given
options of ``accelerate launch``, and otherwise runs in place."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_distributed import free_port
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import trl_diffusion.cli as cli
import trl_diffusion.command_line as command_line
import trl_diffusion.scripts.utils as script_utils
from trl_diffusion.assets import EMBEDDED_MODEL
from trl_diffusion.cli import TRAINING_SCRIPTS, main
from trl_diffusion.command_line import config_file
from trl_diffusion.launching import LAUNCH_MARKERS, LAUNCHED, split_launch_args
from trl_diffusion.recipes import RECIPES_DIR, recipe_command, recipe_names, recipe_path, recipe_summary
from trl_diffusion.scripts import tracerl_math as math_script
from trl_diffusion.scripts.utils import parse_script_args

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("sft", "math", "code")


def one_line_error(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


MARKER_NAMES = {name for names in LAUNCH_MARKERS for name in names}


@pytest.fixture
def not_launched(monkeypatch):
    for name in MARKER_NAMES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def launches(monkeypatch, not_launched):
    """Record what ``accelerate launch`` would be given, without starting anything."""
    seen = []

    def record(args):
        seen.append((args, os.environ.get(LAUNCHED)))

    monkeypatch.setattr("accelerate.commands.launch.launch_command", record)
    return seen


def test_every_recipe_ships_in_the_package_and_is_listed():
    assert sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")) == recipe_names()
    assert len(recipe_names()) == 6 and not (ROOT / "recipes").exists()
    for name in recipe_names():
        assert recipe_path(name) == RECIPES_DIR / f"{name}.yaml"
        assert " (mirrors " in recipe_summary(name)
    assert recipe_summary("trado_4b_tracerl_math") == \
        "TraDo-4B-Instruct TraceRL on math (mirrors Gen-Verse/dLLM-RL configs/rl_trado.yaml)"


def test_the_recipes_command_lists_them(capsys):
    assert main(["recipes"]) == 0
    table, note = capsys.readouterr().out.strip().split("\n\n")
    rows = [line.split() for line in table.splitlines()]
    assert [row[0] for row in rows] == recipe_names()
    assert [row[1:3] for row in rows] == [["trl-diffusion", recipe_command(name)] for name in recipe_names()]
    assert {recipe_command(name) for name in recipe_names()} <= set(TRAINING_SCRIPTS)
    assert str(RECIPES_DIR) in note
    assert main(["recipes", "extra"]) == 2
    one_line_error(capsys, "trl-diffusion recipes")


def test_config_takes_a_recipe_name(tmp_path, monkeypatch):
    """A bare name reads the shipped recipe; a file of that name here, a path or a .yaml name is a file (a missing
    one is reported as missing, never replaced by a recipe); an unknown name lists the recipes."""
    monkeypatch.chdir(tmp_path)
    assert config_file("trado_4b_tracerl_math") == str(RECIPES_DIR / "trado_4b_tracerl_math.yaml")
    for value in ("mine.yaml", "configs/mine", "mine.json"):  # paths: TrlParser says when one is missing
        assert config_file(value) == value
    (tmp_path / "trado_4b_tracerl_math").write_text("max_steps: 3\n")
    assert config_file("trado_4b_tracerl_math") == "trado_4b_tracerl_math"
    with pytest.raises(ValueError, match="no recipe named 'trado_4b'.*trado_4b_tracerl_math, trado_8b"):
        config_file("trado_4b")
    assert command_line.config_flag(["--config=sdar_4b_long_cot_sft", "--seed", "1"], recipes=True) == \
        ["--config", str(RECIPES_DIR / "sdar_4b_long_cot_sft.yaml"), "--seed", "1"]


ON_CPU = ["--bf16", "false", "--tf32", "false", "--use_cpu", "true"]  # the recipes are for GPUs


def test_a_folder_or_a_missing_path_named_like_a_recipe(tmp_path, monkeypatch):
    """Only an existing file wins over a recipe (a folder left by ``--output_dir trado_4b_tracerl_math`` does not); a
    missing path named like a recipe (the old ``recipes/<name>.yaml``) says how to name the recipe; ``eval``'s
    ``--config`` never reads a training recipe."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trado_4b_tracerl_math").mkdir()
    assert config_file("trado_4b_tracerl_math") == str(RECIPES_DIR / "trado_4b_tracerl_math.yaml")
    for old in ("recipes/trado_4b_tracerl_math.yaml", "trado_4b_tracerl_math.yaml"):
        with pytest.raises(ValueError, match=f"--config {old}: no such file; the shipped recipe of that name is "
                                             "--config trado_4b_tracerl_math"):
            config_file(old)
    assert command_line.config_flag(["--config", "trado_4b_tracerl_math"]) == ["--config", "trado_4b_tracerl_math"]


def test_a_recipe_name_parses_as_its_file(capsys):
    def parse(config: str):
        args = command_line.config_flag(["--config", config, *ON_CPU], recipes=True)
        return math_script.make_parser().parse_args_and_config(args)

    by_name, by_file = parse("trado_4b_tracerl_math"), parse(str(recipe_path("trado_4b_tracerl_math")))
    assert by_name == by_file
    assert by_name[2].model_name_or_path == "Gen-Verse/TraDo-4B-Instruct" and by_name[1].num_generations == 16
    with pytest.raises(SystemExit) as exit_:
        parse_script_args(math_script.make_parser(prog="trl-diffusion math"), ["--config", "trado"])
    assert exit_.value.code == 2
    assert "no recipe named 'trado'" in one_line_error(capsys, "trl-diffusion math")


def test_launch_options_go_to_accelerate_and_the_rest_to_the_script():
    parser = math_script.make_parser()
    launch_args, script_args = split_launch_args(parser, [
        "--num_processes", "2", "--max_steps", "3", "--mixed_precision=bf16", "--cpu", "--learning_rate", "-1e-5",
        "--gradient_accumulation_steps", "4", "--debug", "underflow_overflow", "--config", "trado_4b_tracerl_math",
        "--main_process_port", "29555", "--no_such_flag", "1"])
    assert launch_args == ["--num_processes", "2", "--mixed_precision=bf16", "--cpu", "--main_process_port", "29555"]
    # options both have are the script's (TrainingArguments' gradient accumulation and debug); unknown ones too,
    # for its parser to name with the closest real flag
    assert script_args == ["--max_steps", "3", "--learning_rate", "-1e-5", "--gradient_accumulation_steps", "4",
                           "--debug", "underflow_overflow", "--config", "trado_4b_tracerl_math", "--no_such_flag",
                           "1"]


def test_accelerate_config_names_a_file_or_one_trl_ships(tmp_path):
    parser = math_script.make_parser()
    launch_args, _ = split_launch_args(parser, ["--accelerate_config", "zero3", "--max_steps", "1"])
    assert launch_args[0] == "--config_file" and Path(launch_args[1]).name == "zero3.yaml"
    assert Path(launch_args[1]).is_file()
    mine = tmp_path / "mine.yaml"
    mine.write_text("distributed_type: NO\n")
    assert split_launch_args(parser, [f"--accelerate_config={mine}"])[0] == ["--config_file", str(mine)]
    with pytest.raises(ValueError, match="neither a file nor"):
        split_launch_args(parser, ["--accelerate_config", "zero9"])


def test_accelerate_config_twice_or_beside_config_file_is_refused(tmp_path):
    parser = math_script.make_parser()
    mine = tmp_path / "mine.yaml"
    mine.write_text("distributed_type: NO\n")
    assert split_launch_args(parser, ["--accelerate-config", str(mine)])[0] == ["--config_file", str(mine)]
    with pytest.raises(ValueError, match="given twice"):
        split_launch_args(parser, ["--accelerate_config", "zero3", "--accelerate-config=zero2"])
    for other in (["--config_file", str(mine)], [f"--config-file={mine}"]):
        with pytest.raises(ValueError, match="--accelerate_config and --config_file both name"):
            split_launch_args(parser, ["--accelerate_config", "zero3", *other])


def test_a_misspelt_launch_option_is_named_with_the_real_one(capsys, launches):
    with pytest.raises(SystemExit):
        main(["math", "--num_process", "2"])
    assert "--num_process (did you mean --num_processes?)" in one_line_error(capsys, "trl-diffusion math")


def test_what_depends_on_the_launch_is_checked_by_the_launched_processes(monkeypatch, capsys, launches):
    """Before launching, the configs are not built: GRPO's batch checks count the processes (2 x 2 completions make
    a group of 4 on two processes, not on one), and TrainingArguments would take a device in a process that only
    waits. What does not depend on the launch is still checked there, once."""
    from trl_diffusion import TraceRLConfig

    def not_here(self):
        raise AssertionError("a config was built before the launch")

    monkeypatch.setattr(TraceRLConfig, "__post_init__", not_here)
    assert main(["math", "--num_processes", "2", "--multi_gpu", "--per_device_train_batch_size", "2",
                 "--num_generations", "4", "--max_steps", "1"]) == 0
    assert len(launches) == 1
    for argv, message in ((["--model_name_or_path", "./no-such-model"], "no such local directory"),
                          (["--dataset_name", "missing.jsonl"], "no such dataset file: missing.jsonl"),
                          (["--reward_funcs", "no_such_reward"], "no_such_reward")):
        with pytest.raises(SystemExit) as exit_:
            main(["math", *argv])
        assert exit_.value.code == 2 and message in one_line_error(capsys, "trl-diffusion math")


@pytest.mark.parametrize("argv, message", [
    (["math", "--num_eval", "0"], "num_eval must be >= 1"),  # the script's own arguments
    (["code", "--timeout", "0"], "timeout"),
    (["sft", "--save_steps", "10"], "save_steps=10 saves nothing"),  # a check on the TRL config's fields
    (["math", "--dataset_name", ""], "dataset_name is empty"),
])
def test_the_scripts_own_arguments_are_checked_before_launching(argv, message, capsys, launches):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in one_line_error(capsys, f"trl-diffusion {argv[0]}")
    assert launches == []


def test_config_file_values_and_keys_are_checked_before_launching(tmp_path, capsys, launches):
    for text, message in (("max_steps: many\n", "max_steps"), ("no_such_field: 1\n", "no_such_field")):
        (tmp_path / "run.yaml").write_text(text)
        with pytest.raises(SystemExit) as exit_:
            main(["math", "--config", str(tmp_path / "run.yaml")])
        assert exit_.value.code == 2 and message in one_line_error(capsys, "trl-diffusion math")
    assert launches == []


def test_accelerate_refusing_its_settings_is_one_line(tmp_path, capsys, not_launched):
    """The real ``accelerate launch``, refusing before it starts anything: one line, exit status 2."""
    assert main(["sft", "--config_file", str(tmp_path / "missing.yaml"), "--max_steps", "1"]) == 2
    assert "accelerate launch:" in one_line_error(capsys, "trl-diffusion sft")
    assert main(["sft", "--cpu", "--multi_gpu", "--max_steps", "1"]) == 2
    assert "accelerate launch:" in one_line_error(capsys, "trl-diffusion sft")


def test_quiet_keeps_the_runs_exit_status(monkeypatch, capsys, not_launched):
    seen = []

    def fails(args):
        seen.append(args.quiet)
        raise subprocess.CalledProcessError(2, ["python"])

    monkeypatch.setattr("accelerate.commands.launch.launch_command", fails)
    assert main(["math", "-q", "--max_steps", "1"]) == 2 and seen == [False]


def test_a_launch_option_inside_a_launch_is_refused(monkeypatch, capsys, launches):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for command in ("math", "eval"):
        assert main([command, "--num_processes", "2"]) == 2
        assert one_line_error(capsys, f"trl-diffusion {command}").endswith(
            "--num_processes is an option of accelerate launch, but this process was started by a launch already "
            "(LOCAL_RANK and WORLD_SIZE in its environment): give it to that launch.")
    assert launches == []


def test_a_packaged_script_runs_by_its_path():
    """Run by its path, a script's folder comes first on the import path: no module there hides one of the standard
    library's (a ``math.py`` there broke ``import math``)."""
    scripts = ROOT / "trl_diffusion" / "scripts"
    assert {path.stem for path in scripts.glob("*.py")} & sys.stdlib_module_names == set()
    done = subprocess.run([sys.executable, str(scripts / "tracerl_math.py"), "--help"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("usage: tracerl_math.py"), done.stderr[-2000:]
@pytest.mark.parametrize("argv, message", [
    (["--module"], "--module is not an option here"),
    (["--no_python"], "--no_python is not an option here"),
    (["--num_processes"], "--num_processes (an accelerate launch option) needs a value."),
    (["--num_processes", "--max_steps", "1"], "--num_processes (an accelerate launch option) needs a value."),
])
def test_launch_options_it_cannot_take(argv, message, capsys, launches):
    assert main(["math", *argv]) == 2
    assert message in one_line_error(capsys, "trl-diffusion math")
    assert launches == []


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_bad_script_argument_is_reported_once_before_launching(name, capsys, launches):
    with pytest.raises(SystemExit) as exit_:
        main([name, "--max_step", "2", "--learning_rte", "1e-4"])
    assert exit_.value.code == 2
    assert "--learning_rte" in one_line_error(capsys, f"trl-diffusion {name}")
    assert launches == []


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_is_the_scripts_and_names_the_launch_options(name, capsys, launches):
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: trl-diffusion {name} ") and "--output_dir" in out
    assert "(--num_processes, --config_file FILE, --accelerate_config NAME|FILE, --mixed_precision, ...) go to " \
        "accelerate launch" in " ".join(out.split())
    assert launches == []


def test_the_launch_runs_the_command_in_the_started_processes(launches, monkeypatch):
    """What accelerate launch gets: its options, then ``-m trl_diffusion.cli math <script args>``, with
    ``TRL_DIFFUSION_LAUNCHED`` set while it runs (the started processes run in place, never launch again) and
    unset after."""
    monkeypatch.setattr("trl_diffusion.data.loading.load_dataset_builder", lambda *args: None)  # the recipe's Hub set
    script_args = ["--max_steps", "3", "--config", "dream_7b_tracerl_math", *ON_CPU,
                   "--model_name_or_path", str(EMBEDDED_MODEL)]  # offline here
    assert main(["math", "--num_processes", "2", "--multi_gpu", *script_args]) == 0
    ((args, flag),) = launches
    assert flag == "1" and LAUNCHED not in os.environ
    assert args.module and args.training_script == "trl_diffusion.cli" and args.num_processes == 2
    assert args.training_script_args == ["math", *script_args]


@pytest.mark.parametrize("variables", LAUNCH_MARKERS, ids=[names[0] for names in LAUNCH_MARKERS])
def test_a_launched_process_runs_the_script_in_place(variables, monkeypatch, launches):
    ran = []
    for name in variables:
        monkeypatch.setenv(name, "0")
    monkeypatch.setattr(cli, "run_script", lambda main, parser, argv: ran.append((main, parser.prog, argv)))
    assert main(["math", "--max_steps", "3"]) == 0
    assert launches == [] and ran == [(math_script.main, "trl-diffusion math", ["--max_steps", "3"])]


def test_a_variable_a_user_exports_is_no_launch(monkeypatch, launches):
    """``ACCELERATE_USE_CPU`` keeps accelerate on the CPU; alone (not with the rest of what ``accelerate launch``
    sets for its process) it says nothing about a launch, and the command still launches."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")  # no WORLD_SIZE: no torchrun either
    assert main(["math", "--num_processes", "2", "--multi_gpu", "--max_steps", "1"]) == 0
    assert len(launches) == 1 and launches[0][0].num_processes == 2


def test_a_failed_run_exits_with_its_process_status(monkeypatch, capsys, not_launched):
    def one_process_fails(args):
        raise subprocess.CalledProcessError(2, ["python"])

    monkeypatch.setattr("accelerate.commands.launch.launch_command", one_process_fails)
    assert main(["sft", "--max_steps", "1"]) == 2
    assert capsys.readouterr().err == ""  # the process's own error line is all the user sees

    def killed(args):
        raise subprocess.CalledProcessError(-9, ["python"])

    monkeypatch.setattr("accelerate.commands.launch.launch_command", killed)
    assert main(["sft", "--max_steps", "1"]) == 137

    def second_rank_fails(args):  # torchrun then stops the first with SIGTERM
        stopped = ProcessFailure(local_rank=0, pid=122, exitcode=-15, error_file="")
        failed = ProcessFailure(local_rank=1, pid=123, exitcode=2, error_file="")
        failed.timestamp = stopped.timestamp - 1
        raise ChildFailedError("trl_diffusion.cli", {0: stopped, 1: failed})

    monkeypatch.setattr("accelerate.commands.launch.launch_command", second_rank_fails)
    assert main(["code", "--max_steps", "1"]) == 2
    assert "process 1 of the launch exited with status 2" in one_line_error(capsys, "trl-diffusion code")
    assert LAUNCHED not in os.environ


def test_eval_launches_only_when_given_launch_options(monkeypatch, capsys, launches):
    assert main(["eval", "--num_processes", "2", "--multi_gpu", "--max_problems", "4", "--output_dir", ""]) == 0
    ((args, flag),) = launches
    assert flag == "1" and args.num_processes == 2 and args.multi_gpu
    assert args.training_script == "trl_diffusion.cli"
    assert args.training_script_args == ["eval", "--max_problems", "4", "--output_dir", ""]
    # a mistake in eval's own flags: one line before launching
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--num_processes", "2", "--max_problems", "many"])
    assert exit_.value.code == 2 and "--max_problems" in one_line_error(capsys, "trl-diffusion eval")
    assert main(["eval", "--num_process", "2"]) == 2
    assert "--num_process (did you mean --num_processes?)" in one_line_error(capsys, "trl-diffusion eval")
    for argv, message in ((["--device", "cuda:0"], "device 'cuda:0' would put all 2 processes of this launch on one"),
                          (["--model_name_or_path", "./no-such-model"], "no such local directory"),
                          (["--resume", "true", "--output_dir", ""], "set --output_dir"),
                          (["--max_problems", "0"], "max_problems must be positive"),
                          (["--cpu"], "--cpu is not an evaluation setting: the device is eval's own --device"),
                          (["--use-deepspeed"], "--use-deepspeed is not an evaluation setting: evaluation is data "
                                                "parallel only")):
        assert main(["eval", "--num_processes", "2", *argv]) == 2
        assert message in one_line_error(capsys, "trl-diffusion eval")
    assert len(launches) == 1
    ran = []
    monkeypatch.setattr("trl_diffusion.eval.evaluate", lambda config: ran.append(config) or {"metrics": {}})
    assert main(["eval", "--max_problems", "4", "--output_dir", ""]) == 0  # no launch option: in place
    assert len(launches) == 1 and ran[0].max_problems == 4


def test_the_examples_run_the_packaged_scripts():
    """``examples/<name>.py`` is the packaged script's entry point, not a second copy of it."""
    for name in SCRIPTS:
        text = (ROOT / "examples" / f"{name}.py").read_text()
        assert f"from trl_diffusion.scripts.{TRAINING_SCRIPTS[name]} import main, make_parser" in text
        assert "def main" not in text and len(text.splitlines()) < 30


def _install_wheel(tmp_path: Path) -> Path:
    """Build this checkout's wheel (from a copy of what it is built from) and install it, without dependencies, into
    a folder of its own; returns that folder, to put first on ``PYTHONPATH``."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.py", "README.md", "MANIFEST.in", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "trl_diffusion", source / "trl_diffusion", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(source)],
                   check=True, capture_output=True)
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp_path / "site"), str(wheel)], check=True,
                   capture_output=True)
    return tmp_path / "site"


def _run(argv: list[str], cwd: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": str(site)}
    for name in MARKER_NAMES:
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "trl_diffusion.cli", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_an_installed_wheel_trains_with_trl_diffusion_math(tmp_path):
    """End to end from an empty folder with the package installed from its wheel (no checkout): the recipes are
    there, and ``trl-diffusion math`` has accelerate launch start one process, which trains the embedded model for a
    step and prints the script's result. (A failed run: the two-process test below.)"""
    site = _install_wheel(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    listed = _run(["recipes"], work, site)
    table = listed.stdout.split("\n\n")[0]
    assert listed.returncode == 0 and [line.split()[0] for line in table.splitlines()] == recipe_names()
    # the package, its scripts and recipes are the wheel's, not the checkout's
    assert f"The files are in {site / 'trl_diffusion' / 'recipes'};" in listed.stdout, listed.stdout[-500:]

    done = _run(["math", "--max_steps", "1", "--num_eval", "4", "--per_device_train_batch_size", "8",
                 "--output_dir", "run"], work, site)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["output_dir"] == "run" and len(result["accuracy_curve"]) == 2
    assert (work / "run" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_failed_two_process_launch_exits_with_the_failed_process_status(tmp_path):
    """Two processes over gloo (torchrun under accelerate launch): each reports the setting error of its data in one
    line (the launched ``python -m trl_diffusion.cli`` raises the package module's UsageError, no traceback), and
    the command exits 2 with one line naming a process that failed by itself, not 143 for one torchrun stopped."""
    (tmp_path / "bad.jsonl").write_text('{"x": 1}\n')
    config = ROOT / "examples" / "accelerate_configs" / "cpu_two_processes.yaml"
    failed = _run(["math", "--config_file", str(config), "--main_process_port", str(free_port()), "--use_cpu", "true",
                   "--max_steps", "1", "--output_dir", "run", "--dataset_name", "bad.jsonl"], tmp_path, ROOT)
    assert failed.returncode == 2, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("trl-diffusion math: error:")]
    assert errors[-1].startswith("trl-diffusion math: error: process ") and errors[-1].endswith(
        " of the launch exited with status 2 (its error is above).")
    assert 1 <= len(errors[:-1]) <= 2 and all("need a problem/question column" in line for line in errors[:-1])
    assert "Traceback" not in failed.stderr


@pytest.mark.slow
def test_trl_diffusion_eval_on_two_processes(tmp_path):
    """``trl-diffusion eval`` with launch options: accelerate starts two gloo processes, which share the samples; the
    report is printed once and counts both processes."""
    done = _run(["eval", "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()),
                 "--max_problems", "6", "--output_dir", "run"], tmp_path, ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["num_processes"] == 2 and report["num_problems"] == 6
    rows = (tmp_path / report["samples_file"]).read_text().splitlines()
    assert sorted(json.loads(row)["index"] for row in rows) == list(range(6))  # each problem once, by one process


def test_processes_that_would_each_train_alone_are_refused(monkeypatch, capsys):
    """A GPU accelerate config on a machine without CUDA and without ``--use_cpu true``: torchrun starts N processes
    (``LOCAL_RANK``, ``WORLD_SIZE``), but each sees a world of one and would train on all the data into one folder.
    A ``WORLD_SIZE`` exported for something else, without torchrun, is no launch: a single process trains."""
    ran = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    script_utils.run_script(lambda *parsed: ran.append(parsed), math_script.make_parser(),
                            ["--max_steps", "1", "--output_dir", "out"])
    assert len(ran) == 1
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun's process (set after parsing: no process group here)
    with pytest.raises(command_line.UsageError, match="this launch started 2 processes, but each sees only itself "
                       "and would train alone, all writing out: without CUDA, pass --use_cpu true"):
        script_utils.check_one_process_group(ran[0])
    monkeypatch.setenv("WORLD_SIZE", "1")
    script_utils.check_one_process_group(ran[0])


def test_eval_refuses_an_accelerate_config_it_would_not_follow(tmp_path, capsys, launches):
    """TRL's ``zero3`` / ``fsdp2`` and a config with ``use_cpu``: refused, naming eval's own flags; ``multi_gpu`` (its
    bf16 ``mixed_precision`` is left to ``--dtype``) launches; a pinned device with the count from the config too."""
    for config, message in (("zero3", "asks for DEEPSPEED, which is not an evaluation setting: evaluation is data "
                                      "parallel only"),
                            ("fsdp2", "asks for FSDP")):
        assert main(["eval", "--accelerate_config", config, "--max_problems", "2"]) == 2
        assert message in one_line_error(capsys, "trl-diffusion eval")
    cpu = tmp_path / "cpu.yaml"
    cpu.write_text("distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 2\n")
    assert main(["eval", "--config_file", str(cpu)]) == 2
    assert "sets use_cpu, which is not an evaluation setting: the device is eval's own --device" in \
        one_line_error(capsys, "trl-diffusion eval")
    assert main(["eval", "--accelerate_config", "multi_gpu", "--device", "cuda:1"]) == 2
    assert "device 'cuda:1' would put all processes of this launch on one GPU" in \
        one_line_error(capsys, "trl-diffusion eval")
    assert launches == []
    assert main(["eval", "--accelerate_config", "multi_gpu", "--max_problems", "2", "--output_dir", ""]) == 0
    assert len(launches) == 1


def test_resume_true_expands_a_home_output_dir(tmp_path, monkeypatch):
    """``--output_dir ~/runs/x`` (a config file's, or ``--output_dir=~/...``, which no shell expands): transformers
    expands it, and so does the check of ``--resume_from_checkpoint true``, before a launch too."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "runs" / "x" / "checkpoint-5").mkdir(parents=True)
    assert script_utils.resume_checkpoint("true", "~/runs/x") is True


def test_eval_refuses_a_dynamo_backend_it_would_not_use(tmp_path, capsys, launches):
    """``--dynamo_backend inductor`` (or a config file's dynamo_config) was accepted and compiled nothing: accelerate
    compiles a model it prepares, and eval prepares none. ``--dynamo_backend no`` launches."""
    for argv in (["--dynamo_backend", "inductor"], ["--dynamo-mode=max-autotune"]):
        assert main(["eval", "--num_processes", "2", *argv, "--max_problems", "2"]) == 2
        assert "is not an evaluation setting: evaluation compiles nothing" in one_line_error(capsys,
                                                                                             "trl-diffusion eval")
    compiled = tmp_path / "dynamo.yaml"
    compiled.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\ndynamo_config:\n  dynamo_backend: INDUCTOR\n")
    assert main(["eval", "--config_file", str(compiled), "--max_problems", "2"]) == 2
    assert "sets dynamo_backend INDUCTOR, which is not an evaluation setting" in one_line_error(capsys,
                                                                                              "trl-diffusion eval")
    assert launches == []
    assert main(["eval", "--num_processes", "2", "--multi_gpu", "--dynamo_backend", "no", "--max_problems", "2"]) == 0
    assert len(launches) == 1
