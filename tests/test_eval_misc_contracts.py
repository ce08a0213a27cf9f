"""Contracts of the evaluation loop (``trl_diffusion/eval/evaluate.py``) and of the small modules the trainers share
(best-checkpoint metric, whole saves under sharded FSDP, checkpoint files, eval padding, vocabulary rows, the mask
token's wording, the math-verify check): behaviours no other test pinned."""

from __future__ import annotations

import importlib
import json
import logging
import math
from types import SimpleNamespace

import pytest

from trl_diffusion.eval import EvalConfig, evaluate, pass_at_k, score_completions
from trl_diffusion.eval.datasets import EvalProblem
from trl_diffusion.eval.evaluate import format_prompt
from trl_diffusion.testing import build_tokenizer, tiny_model

evaluate_module = importlib.import_module("trl_diffusion.eval.evaluate")  # the package exports a function of that name

FAST = dict(max_new_tokens=4, block_length=4, denoising_steps=4, temperature=0.0, progress=False, output_dir=None)
MATH = [{"question": "What is 1+1?", "answer": "2"}, {"question": "What is 2+2?", "answer": "4"}]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model("sdar"), build_tokenizer()


def math_problem(prompt="What is 1+2?", answer="3"):
    return EvalProblem(id="p0", prompt=prompt, task="math", answer=answer)


# ------------------------------------------------------------------------------------------------ EvalConfig


def test_an_unknown_remasking_strategy_is_refused_by_the_config():
    """An unknown remasking_strategy fails when the config is built, not after the model has loaded."""
    with pytest.raises(ValueError, match="remasking_strategy must be one of"):
        EvalConfig(remasking_strategy="lowest_confidence")
    assert EvalConfig(remasking_strategy="low_confidence_static").remasking_strategy == "low_confidence_static"


def test_the_arithmetic_defaults_give_way_to_values_that_were_set():
    """arithmetic's generation defaults fill only what was left unset; other datasets get none."""
    assert EvalConfig().generate_kwargs("arithmetic") == {"max_new_tokens": 16, "temperature": 0.0}
    assert EvalConfig(temperature=0.7, max_new_tokens=8).generate_kwargs("arithmetic") == {
        "max_new_tokens": 8,
        "temperature": 0.7,
    }
    assert EvalConfig().generate_kwargs("gsm8k") == {}


def test_use_cache_is_read_whatever_its_case():
    """use_cache from the command line or a config file is read case-insensitively."""
    assert EvalConfig(use_cache="True").generate_kwargs()["use_cache"] is True
    assert EvalConfig(use_cache="FALSE").generate_kwargs()["use_cache"] is False
    assert EvalConfig(use_cache="Dual").generate_kwargs()["use_cache"] == "dual"


def test_pass_k_defaults_and_bounds():
    """pass@k is reported for k = 1 and k = num_samples by default; k = 0 and num_samples = 0 are refused."""
    assert EvalConfig(num_samples=4).resolved_pass_k() == [1, 4]
    assert EvalConfig().resolved_pass_k() == [1]
    assert EvalConfig(num_samples=4, pass_k=[2, 2]).resolved_pass_k() == [2]
    with pytest.raises(ValueError, match=r"pass@k needs 1 <= k <= num_samples \(4\); got k=\[0\]"):
        EvalConfig(num_samples=4, pass_k=[0, 1]).resolved_pass_k()
    with pytest.raises(ValueError, match="num_samples must be >= 1, got 0"):
        EvalConfig(num_samples=0).resolved_pass_k()


def test_pass_at_k_refuses_more_correct_samples_than_samples():
    """pass_at_k(n, c, k) with c > n is an error, not a number."""
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(2, 3, 1)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(2, -1, 1)


def test_math_verify_plain_is_math_verify_s_own_comparison():
    """math_grader='math_verify_plain' scores without the answer rules (5! for 120); 'math_verify' keeps them."""
    problem, completion = math_problem(answer="120"), ["The answer is $\\boxed{5!}$."]
    plain = EvalConfig(math_grader="math_verify_plain").math_reward()
    ruled = EvalConfig(math_grader="math_verify").math_reward()
    assert score_completions([problem], completion, math_reward=plain)[0]["reward"] == 1.0
    assert score_completions([problem], completion, math_reward=ruled)[0]["reward"] == 0.0


# ------------------------------------------------------------------------------------------------ scoring


def test_score_completions_needs_one_completion_per_problem():
    """A completions list of another length than the problems is refused, not zipped short."""
    with pytest.raises(ValueError, match="2 problems but 1 completions"):
        score_completions([math_problem(), math_problem()], ["\\boxed{3}"])


CODE = EvalProblem(
    id="c0",
    prompt="Write f.",
    task="code",
    tests=["assert f() == 1", "assert f() == 2", "assert f() == 3", "assert f() == 4"],
)


def test_a_code_completion_without_code_counts_every_test():
    """A code completion with no code block fails all of the problem's tests (tests_total is their number)."""
    [result] = score_completions([CODE], ["I cannot write it."])
    assert result == {"reward": 0.0, "status": "no_code", "tests_passed": 0, "tests_total": 4, "errors": []}


def test_a_failing_program_keeps_its_first_three_errors():
    """The errors recorded for a failing code completion are the first three."""
    [result] = score_completions([CODE], ["```python\ndef f():\n    return 0\n```"])
    assert result["reward"] == 0.0 and result["tests_total"] == 4 and result["tests_passed"] == 0
    assert len(result["errors"]) == 3


# ------------------------------------------------------------------------------------------------ prompts


def test_the_system_prompt_is_the_chat_s_first_message():
    """system_prompt goes into the chat template's prompt, before the user turn."""
    tokenizer = build_tokenizer()
    problem = math_problem()
    with_system = format_prompt(tokenizer, problem, EvalConfig(apply_chat_template=True, system_prompt="Be brief."))
    without = format_prompt(tokenizer, problem, EvalConfig(apply_chat_template=True))
    assert "Be brief." in with_system and "Be brief." not in without
    assert with_system.index("Be brief.") < with_system.index(problem.prompt)


def test_the_auto_dtype_loads_float32_on_a_cpu():
    """dtype='auto' loads the weights in float32 on a CPU (bfloat16 only on a GPU); a named dtype is used as named;
    the model is in eval mode."""
    import torch

    model, _ = evaluate_module.load_model_and_tokenizer(EvalConfig(device="cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.float32} and not model.training
    model, _ = evaluate_module.load_model_and_tokenizer(EvalConfig(device="cpu", dtype="bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


# ------------------------------------------------------------------------------------------------ evaluate()


def test_a_batch_size_below_one_is_refused(model_and_tokenizer):
    """batch_size=0 is refused by name before any generation."""
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        evaluate(model=model, tokenizer=tokenizer, dataset=MATH, batch_size=0, **FAST)


def test_a_loaded_model_without_its_tokenizer_is_refused(model_and_tokenizer):
    """A model object given without a tokenizer is refused with the fix, not an AttributeError."""
    model, _ = model_and_tokenizer
    with pytest.raises(ValueError, match="a loaded model needs its tokenizer"):
        evaluate(model=model, dataset=MATH, **FAST)


def test_greedy_samples_of_a_problem_are_warned_about(model_and_tokenizer, caplog):
    """num_samples=2 with greedy decoding warns that the samples will be the same."""
    model, tokenizer = model_and_tokenizer
    with caplog.at_level(logging.WARNING, logger=evaluate_module.__name__):
        evaluate(model=model, tokenizer=tokenizer, dataset=MATH[:1], num_samples=2, **FAST)
    assert "num_samples=2 with greedy decoding" in caplog.text


def test_the_report_of_rows_given_directly(model_and_tokenizer, tmp_path):
    """Rows given directly are the 'custom' dataset; a math report has no code grader; the report returned is the
    metrics file's content."""
    model, tokenizer = model_and_tokenizer
    report = evaluate(model=model, tokenizer=tokenizer, dataset=MATH, **{**FAST, "output_dir": str(tmp_path)})
    assert report["dataset"] == report["dataset_name"] == "custom"
    assert report["math_grader"] == "math_verify" and report["code_grader"] is None
    assert isinstance(report["generation"]["stop_token_ids"], list)
    assert json.loads(open(report["metrics_file"]).read()) == report
    rows = [json.loads(line) for line in open(report["samples_file"]).read().splitlines()]
    assert len(rows) == 2 and all(row["denoising_steps"] >= 1 and row["tokens_per_step"] > 0 for row in rows)


def test_the_earlier_name_dataset_split_is_still_accepted(model_and_tokenizer):
    """evaluate(dataset_split=...) is the earlier name of dataset_test_split; like it, it selects within a dataset
    loaded by name, so with rows passed in (where both were ignored) it is refused under the field's name."""
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match=r"dataset_test_split='validation': it selects within a dataset evaluate\(\) "
                                         "loads by name"):
        evaluate(model=model, tokenizer=tokenizer, dataset=MATH, dataset_split="validation", **FAST)
    with pytest.raises(ValueError, match=r"dataset_config='main', dataset_test_split='dev': these select"):
        evaluate(model=model, tokenizer=tokenizer, dataset=MATH, dataset_config="main", dataset_test_split="dev",
                 **FAST)
    with pytest.raises(ValueError, match="EvalProblem's prompt is used as it is"):
        evaluate(model=model, tokenizer=tokenizer, prompt_template="Q: {question} =", **FAST,
                 dataset=[EvalProblem(id="0", prompt="What is 1+2?", task="math", answer="3")])
    assert evaluate(model=model, tokenizer=tokenizer, dataset=MATH, **FAST)["num_problems"] == 2


def test_a_model_without_diffusion_generation_is_refused(model_and_tokenizer):
    """A model object that is no trl_diffusion model is refused by name."""
    import torch

    _, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match="Linear is not a trl_diffusion model"):
        evaluate(model=torch.nn.Linear(2, 2), tokenizer=tokenizer, dataset=MATH, **FAST)


def test_a_report_written_before_sources_were_recorded_is_replaced(model_and_tokenizer, tmp_path):
    """A metrics file without 'sources' (an older report) is replaced by the next run into the same files."""
    model, tokenizer = model_and_tokenizer
    settings = {**FAST, "output_dir": str(tmp_path)}
    report = evaluate(model=model, tokenizer=tokenizer, dataset=MATH, **settings)
    with open(report["metrics_file"], "w") as handle:
        json.dump({key: value for key, value in report.items() if key != "sources"}, handle)
    again = evaluate(model=model, tokenizer=tokenizer, dataset=MATH, **settings)
    assert again["metrics_file"] == report["metrics_file"]
    assert json.loads(open(report["metrics_file"]).read())["sources"] == report["sources"]


def test_a_problem_one_position_too_long_is_refused(model_and_tokenizer):
    """A prompt and its new tokens needing one position more than the model has is refused before generating; one
    that needs exactly the model's positions runs."""
    _, tokenizer = model_and_tokenizer
    rows = [{"question": "1+1=", "answer": "2"}]  # 4 tokens (character-level, no BOS) + 4 new = 8 positions
    settings = dict(tokenizer=tokenizer, dataset=rows, prompt_template="{question}", apply_chat_template=False, **FAST)
    with pytest.raises(
        ValueError,
        match=r"1 of 1 problems do not fit the model's 7 positions: '0' \(4 prompt \+ 4 "
        r"new tokens, needs 8\)",
    ):
        evaluate(model=tiny_model("dream", max_position_embeddings=7), **settings)
    assert evaluate(model=tiny_model("dream", max_position_embeddings=8), **settings)["num_problems"] == 1


def test_the_arithmetic_task_is_named_whatever_its_case(model_and_tokenizer):
    """dataset='Arithmetic' is the built-in task, identified as 'arithmetic' in the report's sources."""
    model, tokenizer = model_and_tokenizer
    report = evaluate(model=model, tokenizer=tokenizer, dataset="Arithmetic", max_problems=2, **FAST)
    assert report["dataset"] == "arithmetic" and report["sources"]["dataset"] == "arithmetic"


def test_boxed_rate_and_sandbox_errors_count_what_they_name():
    """boxed_rate counts non-empty boxed answers; num_sandbox_errors counts only sandbox errors, not failing code."""
    math_rows = [
        {
            "index": i,
            "sample": 0,
            "reward": 0.0,
            "correct": False,
            "length": 3,
            "clipped": False,
            "prediction": prediction,
        }
        for i, prediction in enumerate(["3", "", None, "4"])
    ]
    metrics = evaluate_module._metrics(math_rows, [math_problem()], 1, [1])
    assert metrics["boxed_rate"] == pytest.approx(0.5)
    code_rows = [
        {"index": i, "sample": 0, "reward": 0.0, "correct": False, "length": 3, "clipped": False, "status": status}
        for i, status in enumerate(["sandbox_error", "failed", "no_code", "timeout"])
    ]
    metrics = evaluate_module._metrics(code_rows, [CODE], 1, [1])
    assert metrics["num_sandbox_errors"] == 1 and metrics["accuracy"] == 0.0


# ------------------------------------------------------------------------------------------------ best metric


def training_args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)


def test_usable_best_metric_names_the_metric_with_or_without_its_prefix(caplog):
    """metric_for_best_model with or without 'eval_' names the same metric: None becomes NaN, warned about with the
    step and the cause; no metric_for_best_model leaves the metrics as they are."""
    from trl_diffusion.best_metric import usable_best_metric

    for name in ("reward", "eval_reward"):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            metrics = usable_best_metric({"eval_reward": None, "eval_loss": 1.0}, name, 7, "no reward")
        assert math.isnan(metrics["eval_reward"]) and metrics["eval_loss"] == 1.0
        assert "'eval_reward' is NaN at step 7: no reward" in caplog.text
    given = {"eval_reward": None}
    assert usable_best_metric(given, None, 7, "no reward") is given
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        assert usable_best_metric({"eval_reward": 0.5}, "reward", 7, "no reward") == {"eval_reward": 0.5}
    assert "NaN" not in caplog.text


def test_the_best_metric_must_name_an_eval_set(tmp_path):
    """With a dict of eval datasets metric_for_best_model must start with a set's name and '_' ('eval_' prefix or
    not); it is not looked up without evaluation or with one eval dataset."""
    from trl_diffusion.best_metric import check_best_metric_names_a_set

    sets = {"a": [1], "b": [2]}
    for metric in ("a_loss", "eval_b_loss"):
        check_best_metric_names_a_set(
            sets, training_args(tmp_path, eval_strategy="steps", metric_for_best_model=metric)
        )
    for metric in ("loss", "ab_loss", "eval_loss"):
        with pytest.raises(ValueError, match=rf"metric_for_best_model='{metric}' is logged by no evaluation.*'a_"):
            check_best_metric_names_a_set(
                sets, training_args(tmp_path, eval_strategy="steps", metric_for_best_model=metric)
            )
    check_best_metric_names_a_set(sets, training_args(tmp_path, eval_strategy="no", metric_for_best_model="loss"))
    check_best_metric_names_a_set([1], training_args(tmp_path, eval_strategy="steps", metric_for_best_model="loss"))
    check_best_metric_names_a_set({}, training_args(tmp_path, eval_strategy="steps", metric_for_best_model="loss"))


# ------------------------------------------------------------------------------------------------ whole saves


class SavingTrainer:
    """What ``save_model_whole`` reads of a trainer, recording the saves and pushes it makes."""

    def __init__(self, state_dict_type="StateDictType.SHARDED_STATE_DICT", fsdp=True, push_to_hub=False):
        self.is_fsdp_enabled = fsdp
        plugin = SimpleNamespace(state_dict_type=state_dict_type)
        self.accelerator = SimpleNamespace(
            state=SimpleNamespace(fsdp_plugin=plugin), get_state_dict=lambda model: {"w": "full"}
        )
        self.model = object()
        self.args = SimpleNamespace(output_dir="out", push_to_hub=push_to_hub, hub_revision=None)
        self.calls = []

    def _save(self, output_dir, state_dict=None):
        self.calls.append(("whole", output_dir, state_dict))

    def push_to_hub(self, commit_message, revision):
        self.calls.append(("push", commit_message))

    def save_model(self, output_dir, internal_call):
        self.calls.append(("transformers", output_dir, internal_call))


def test_sharded_fsdp_is_any_state_dict_but_the_full_one():
    """Only FSDP with a state dict type other than FULL_STATE_DICT saves whole."""
    from trl_diffusion.full_save import sharded_fsdp

    assert sharded_fsdp(SavingTrainer())
    assert sharded_fsdp(SavingTrainer("StateDictType.LOCAL_STATE_DICT"))
    assert not sharded_fsdp(SavingTrainer("StateDictType.FULL_STATE_DICT"))
    assert not sharded_fsdp(SavingTrainer(fsdp=False))


@pytest.mark.parametrize("push", [False, True])
def test_which_saves_are_whole_under_sharded_fsdp(push):
    """A checkpoint's save is transformers'; push_to_hub()'s save (internal, no folder) is whole into output_dir and
    pushes nothing itself; the user's save is whole and pushes when push_to_hub is set."""
    from trl_diffusion.full_save import save_model_whole

    trainer = SavingTrainer(push_to_hub=push)
    save_model_whole(trainer, "out/checkpoint-1", True, trainer.save_model)
    assert trainer.calls == [("transformers", "out/checkpoint-1", True)]
    trainer.calls.clear()
    save_model_whole(trainer, None, True, trainer.save_model)
    assert trainer.calls == [("whole", "out", {"w": "full"})]
    trainer.calls.clear()
    save_model_whole(trainer, "final", False, trainer.save_model)
    assert trainer.calls == [("whole", "final", {"w": "full"})] + ([("push", "Model save")] if push else [])
    trainer = SavingTrainer("StateDictType.FULL_STATE_DICT", push_to_hub=push)
    save_model_whole(trainer, "final", False, trainer.save_model)
    assert trainer.calls == [("transformers", "final", False)]


# ------------------------------------------------------------------------------------------------ checkpoint files


class CheckpointingTrainer:
    def __init__(self, output_dir, should_save=True, step=3):
        self.args = SimpleNamespace(should_save=should_save)
        self.state = SimpleNamespace(global_step=step)
        self.accelerator = SimpleNamespace(wait_for_everyone=lambda: None)
        self._output_dir = str(output_dir)

    def _get_output_dir(self, trial):
        return self._output_dir


def test_a_checkpoint_folder_is_cleared_of_an_earlier_run_s_files(tmp_path):
    """An earlier run's trainer_state.json and the trainer's own files and folders are removed, whatever characters
    the output folder's name holds; other files stay; a process that does not save removes nothing."""
    from trl_diffusion.trainers.checkpoint_files import start_checkpoint_folder

    output = tmp_path / "run[1]"
    folder = output / "checkpoint-3"
    (folder / "ours_dir").mkdir(parents=True)
    (folder / "ours_dir" / "x.bin").write_text("old")
    for name in ("trainer_state.json", "ours.json", "model.safetensors"):
        (folder / name).write_text("old")
    assert start_checkpoint_folder(
        CheckpointingTrainer(output, should_save=False), None, ("ours.json", "ours_dir")
    ) == str(folder)
    assert sorted(p.name for p in folder.iterdir()) == [
        "model.safetensors",
        "ours.json",
        "ours_dir",
        "trainer_state.json",
    ]
    assert start_checkpoint_folder(CheckpointingTrainer(output), None, ("ours.json", "ours_dir")) == str(folder)
    assert [p.name for p in folder.iterdir()] == ["model.safetensors"]
    new = start_checkpoint_folder(CheckpointingTrainer(output, step=4), None, ())
    assert new == str(output / "checkpoint-4") and (output / "checkpoint-4").is_dir()


def test_a_checkpoint_json_file_is_read_back_or_none(tmp_path):
    """read_checkpoint_json: the file's content; None without a checkpoint or without the file."""
    from trl_diffusion.trainers.checkpoint_files import read_checkpoint_json, refuse_save_only_model

    (tmp_path / "stats.json").write_text(json.dumps({"n": 2}))
    assert read_checkpoint_json(str(tmp_path), "stats.json") == {"n": 2}
    assert read_checkpoint_json(str(tmp_path), "other.json") is None
    assert read_checkpoint_json(None, "stats.json") is None
    with pytest.raises(
        ValueError,
        match=r"ckpt was saved with save_only_model=True.*RNG state, or a value model\).*"
        r"\(model=ckpt\)",
    ):
        refuse_save_only_model("ckpt", "model=ckpt", ", or a value model")


# ------------------------------------------------------------------------------------------------ eval padding


def padded_accelerator(loader, remainder, process_index, end=True):
    state = SimpleNamespace(active_dataloader=loader, end_of_dataloader=end, remainder=remainder)
    return SimpleNamespace(gradient_state=state, process_index=process_index)


def test_the_real_rows_of_a_padded_last_batch_per_process():
    """In process order the first `remainder` rows of the padded global batch are real: each process keeps its share;
    a batch that is not the last, or a dataset that fills its batches, is all real (None)."""
    from trl_diffusion.trainers.eval_padding import padded_eval_batch, real_eval_rows

    loader = object()
    assert [real_eval_rows(padded_accelerator(loader, 5, rank), loader, 4) for rank in range(3)] == [None, 1, 0]
    assert real_eval_rows(padded_accelerator(loader, 4, 0), loader, 4) is None
    assert real_eval_rows(padded_accelerator(loader, 5, 1, end=False), loader, 4) is None
    assert not padded_eval_batch(padded_accelerator(loader, 0, 0), loader)
    assert padded_eval_batch(padded_accelerator(loader, 1, 0), loader)


def test_evaluation_metrics_take_the_prefix_and_leave_nan_out():
    """TRL's eval metrics are named with evaluate()'s prefix, each the mean of its non-NaN values (NaN if none)."""
    from trl_diffusion.trainers.eval_padding import prefixed_eval_metrics

    means = prefixed_eval_metrics({"reward": [1.0, math.nan, 3.0], "kl": [math.nan]}, "test_a")
    assert set(means) == {"test_a_reward", "test_a_kl"}
    assert means["test_a_reward"] == pytest.approx(2.0) and math.isnan(means["test_a_kl"])


def test_the_evaluated_loader_is_named_only_while_evaluation_runs():
    """EvaluatedLoader names the dataloader during evaluation_loop, and None after it, also when it fails."""
    from trl_diffusion.trainers.eval_padding import EvaluatedLoader

    class Base:
        def evaluation_loop(self, dataloader, fail=False):
            self.seen = self._evaluated_loader
            if fail:
                raise RuntimeError("failed")
            return "output"

    class Trainer(EvaluatedLoader, Base):
        pass

    trainer, loader = Trainer(), object()
    assert trainer.evaluation_loop(loader) == "output" and trainer.seen is loader
    assert trainer._evaluated_loader is None
    with pytest.raises(RuntimeError):
        trainer.evaluation_loop(loader, fail=True)
    assert trainer.seen is loader and trainer._evaluated_loader is None


# ------------------------------------------------------------------------------------------------ mask token


def test_the_mask_token_and_row_lists_are_worded_one_way():
    """The mask token is named with its string when known; lists show five items, then ', ...'."""
    from trl_diffusion.mask_token import first_few, mask_token_name

    assert mask_token_name(3, "<|MASK|>") == "the mask token '<|MASK|>' (id 3)"
    assert mask_token_name(3) == mask_token_name(3, None) == "the mask token (id 3)"
    assert first_few([1, 2, 3, 4, 5]) == "1, 2, 3, 4, 5"
    assert first_few(list(range(1, 7))) == "1, 2, 3, 4, 5, ..."
    assert first_few(["a", "b"], limit=1) == "a, ..."


@pytest.mark.parametrize("setting", [{"dtype": "float16"}, {"device": "cpu"}, {"fused_kernels": True},
                                     {"tokenizer_name_or_path": "/no/such/tokenizer"}])
def test_loading_settings_with_a_model_passed_in_are_refused(setting):
    """They apply when evaluate() loads the model, and were ignored for one passed in (float16 asked, float32 run)."""
    from trl_diffusion.testing import build_tokenizer, tiny_model

    name = next(iter(setting))
    with pytest.raises(ValueError, match=f"{name}=.*: loading settings, which apply when evaluate\\(\\) loads the "
                                         "model"):
        evaluate(model=tiny_model("sdar"), tokenizer=build_tokenizer(), max_problems=2, output_dir="",
                 progress=False, **setting)
