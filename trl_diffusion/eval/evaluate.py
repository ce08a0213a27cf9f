"""The evaluation loop: prompts through the chat template, ``model.generate`` in left-padded batches, scoring with the
rewards (math-verify; sandboxed code execution), metrics (accuracy, unbiased pass@k, length, tokens per step,
throughput) and a per-sample JSONL file."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sized
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from ..generation.sampler import check_cuda_graphs
from ..generation.sampling import REMASKING_STRATEGIES, stable_seed
from ..mask_token import SANITIZE_CONTROL_TOKENS, first_few, mask_token_name
from ..models.kernels import set_fused_kernels
from ..rewards import (
    MathAccuracyReward,
    OfficialMathReward,
    SandboxLimits,
    extract_code,
    last_boxed_content,
    run_tests,
)
from ..rewards.dllm_rl_code import (
    extract_code_official,
    official_stdio_program,
    run_official,
    stdio_program,
    time_limit_seconds,
)
from ..rewards.dllm_rl_math import extract_boxed_answer
from ..states import CanvasLayout, check_chat_template_kwargs, check_field_types, left_pad, max_positions
from .datasets import PRESET_MODEL_TYPES, PROMPT_PRESETS, EvalProblem, load_eval_problems, problems_from_rows
from .processes import (
    EvalProcesses,
    check_launch_device,
    check_same_inputs,
    describe,
    launch_world_size,
    merge_runs,
    shared_error,
)
from .resume import card_path, part_path, part_paths, problem_digest, resumed_rows, run_card, sample_line, start_files

__all__ = ["CODE_GRADERS", "EvalConfig", "evaluate", "pass_at_k", "score_completions"]

logger = logging.getLogger(__name__)

_GENERATE_FIELDS = ("max_new_tokens", "block_length", "denoising_steps", "remasking_strategy", "confidence_threshold",
                    "temperature", "top_k", "top_p", "use_cache", "stop_token_ids", "steps", "alg", "alg_temp", "eps",
                    "cfg_scale", "cuda_graphs")
_DATASET_GENERATION_DEFAULTS = {"arithmetic": {"max_new_tokens": 16, "temperature": 0.0}}
_BATCH_SIZE, _DATASET_BATCH_SIZE = 16, {"arithmetic": 100}  # the tiny model's short rows: few, wide batches
MATH_GRADERS = ("math_verify", "math_verify_plain", "official")
"""``math_grader`` values: math-verify with the answer rules (our reward), math-verify's own comparison (without them,
comparable with other math-verify evaluations), or dLLM-RL's ``is_equal`` as its ``reward/reward.py`` scores."""
CODE_GRADERS = ("sandbox", "official")
"""``code_grader`` values: the code reward's extraction and ``code_timeout`` (ours), or dLLM-RL's
(``reward/execute.py``: ``python`` fences only, the row's ``test_time_limit``, one run per stdio case)."""
DTYPES = ("auto", "bfloat16", "float16", "float32")
"""``dtype`` values: ``auto`` is bfloat16 on GPU, float32 on CPU."""
_CACHE_VALUES = {"true": True, "false": False, "exact": "exact", "none": "none", "prefix": "prefix", "dual": "dual"}


def _arg(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class EvalConfig:
    """Arguments of ``trl-diffusion eval`` and :func:`evaluate`. Generation flags left at ``None`` come from the
    model's ``generation_config``, then the family defaults (see ``docs/generation.md``)."""

    model_name_or_path: str | None = _arg(None, "Model path or Hub id (default: the embedded tiny model).")
    tokenizer_name_or_path: str | None = _arg(None, "Tokenizer path or Hub id (default: the model's).")
    dtype: str = _arg("auto", "Weights dtype: auto (bfloat16 on GPU, float32 on CPU), bfloat16, float16, float32.",
                      choices=list(DTYPES))
    device: str | None = _arg(None, "Device, e.g. cuda:0 or cpu, as torch.device parses it (default: cuda if "
                              "available; under accelerate launch / torchrun each process's own GPU).")
    dataset_name: str = _arg("arithmetic", "math500, gsm8k, aime2024, humaneval, mbpp, arithmetic, a local "
                             ".json/.jsonl/.parquet file, or a Hub dataset id owner/name (format detected from "
                             "columns). Also --dataset.", aliases=["--dataset"])
    dataset_config: str | None = _arg(None, "Hub dataset config (default: the short name's, else none).")
    dataset_test_split: str | None = _arg(None, "Hub dataset split to evaluate (default: the short name's, else "
                                          "'test'). Also --dataset_split.", aliases=["--dataset_split"])
    max_problems: int | None = _arg(None, "Evaluate only the first N problems.")
    num_samples: int = _arg(1, "Completions per problem (n); accuracy is the mean over all of them.")
    pass_k: list[int] | None = _arg(None, "k values for pass@k (each <= num_samples; default: 1 and num_samples).")
    batch_size: int | None = _arg(None, "Sequences per generate() call (default: 16; 100 for arithmetic).")
    seed: int = _arg(0, "Seed of the sampling generators: each sample has its own, keyed by (seed, problem index, "
                                 "sample index).")
    prompt_template: str | None = _arg(None, "User turn with a {question} placeholder (default: per task), or a "
                                       "dLLM-RL prompt by name, used without the chat template: dllm_rl_sdar (SDAR "
                                       "/ TraDo), dllm_rl_sdar_think, dllm_rl_llada, dllm_rl_dream.")
    system_prompt: str | None = _arg(None, "Optional system message (needs the chat template).")
    apply_chat_template: bool | None = _arg(None, "Wrap the prompt in the tokenizer's chat template (default: true, "
                                            "false for the embedded model and the models trained from it, e.g. "
                                            "outputs/math: it was trained on plain prompts).")
    chat_template_kwargs: dict | str | None = _arg(None, "Keyword arguments of the chat template, as GRPOConfig's "
                                                   "(a JSON object on the command line), e.g. '{\"enable_thinking\": "
                                                   "false}' for SDAR / TraDo's Qwen3 template: the values the model "
                                                   "was trained with. Needs the chat template.")
    start_with_think: bool = _arg(False, "Append <think> after the generation prompt (long-CoT models).")
    max_new_tokens: int | None = _arg(None, "Tokens to generate per completion.")
    block_length: int | None = _arg(None, "Tokens per block.")
    denoising_steps: int | None = _arg(None, "Denoising steps per block (<= block_length).")
    remasking_strategy: str | None = _arg(None, "sequential, low_confidence_static, low_confidence_dynamic, random, "
                                          "topk_margin or entropy (Dream's origin: --alg origin).")
    confidence_threshold: float | None = _arg(None, "Threshold of low_confidence_dynamic.")
    temperature: float | None = _arg(None, "Sampling temperature (0 = greedy; default: the model's generation "
                                     "config, greedy when it sets none).")
    top_k: int | None = _arg(None, "Top-k filtering (0 = off; default: the model's generation config, e.g. SDAR's "
                             "and TraDo's top_k 20, else off).")
    top_p: float | None = _arg(None, "Top-p filtering (1.0 = off; default: the model's generation config, e.g. "
                               "SDAR's and TraDo's top_p 0.95, else off).")
    use_cache: str | None = _arg(None, "KV cache: true (SDAR exact), false, prefix or dual (LLaDA/Dream).")
    stop_token_ids: list[int] | None = _arg(None, "Token ids (each >= 0) that end a completion (default: the model's "
                                            "eos).")
    steps: int | None = _arg(None, "Dream: total denoising steps over the whole generation.")
    alg: str | None = _arg(None, "Dream: origin, maskgit_plus, topk_margin or entropy.")
    alg_temp: float | None = _arg(None, "Dream: confidence temperature.")
    eps: float | None = _arg(None, "Dream: final mask ratio of the linspace schedule.")
    cfg_scale: float | None = _arg(None, "LLaDA classifier-free guidance scale.")
    cuda_graphs: str | None = _arg(None, "auto: on CUDA, replay the cached denoising steps as CUDA graphs (the "
                                   "default, after the model's generation config); off: eager.",
                                   choices=["auto", "off"])
    fused_kernels: bool = _arg(False, "Compile the layers' elementwise chains into fused kernels "
                               "(trl_diffusion.set_fused_kernels): fewer GPU kernels per step; bf16 values differ "
                               "from eager in their last bits; the first calls compile.")
    math_grader: str = _arg("math_verify", "Math scoring: math_verify (the last \\boxed{}, else math-verify's own "
                            "extraction from the text, with the training reward's answer rules), math_verify_plain "
                            "(the same without them: math-verify's own comparison) or official (dLLM-RL's eval: "
                            "the last \\boxed{} only, Hendrycks is_equiv, else sympy within 1 s; no box scores 0).",
                            choices=list(MATH_GRADERS))
    code_grader: str = _arg("sandbox", "Code scoring: sandbox (the code reward's extraction: the last ```python, "
                            "else untagged, block; --code_timeout per completion) or official (dLLM-RL's execute.py: "
                            "the last ```python block only; the row's test_time_limit (default 1 s) + 2 s per "
                            "function completion, test_time_limit per stdio case, each case its own run).",
                            choices=list(CODE_GRADERS))
    code_timeout: float = _arg(10.0, "Seconds (finite, > 0) per code completion (program and all its tests) in the "
                               "sandbox (code_grader sandbox).")
    code_memory_mb: int = _arg(1024, "Memory of a code sandbox run, MiB, >= 1 (whole sandbox with a memory cgroup, "
                                "always each process's address space).")
    code_max_output_bytes: int = _arg(1_000_000, "Bytes a code sandbox run may print (stdout+stderr) and bytes of its "
                                      "report (its stdio cases' outputs, JSON), >= 1; more fails the completion "
                                      "(dLLM-RL has no cap).")
    code_workers: int = _arg(4, "Code sandboxes run concurrently (>= 1).")
    output_dir: str | None = _arg("eval_results", "Where to write <model>__<dataset>.jsonl and .metrics.json "
                                  "(empty: write nothing).")
    progress: bool = _arg(True, "Show progress bars: the evaluation's, and transformers' while the model loads.")
    resume: bool = _arg(False, "Keep the samples an interrupted run of the same evaluation wrote to output_dir and "
                        "generate only the missing ones (the report is that of an uninterrupted run); refused if "
                        "the run card differs (batch_size, max_problems, pass_k, code_workers, the GPU index and "
                        "the number of processes may change).")

    def __post_init__(self) -> None:
        """Field types (bool / int / float fields, see ``states.check_field_types``) and the ranges of the load and
        code-sandbox settings, checked before any model or dataset is loaded."""
        check_field_types(self)
        if not isinstance(self.dataset_name, str) or not self.dataset_name.strip():
            raise ValueError(f"dataset_name must name a dataset (a short name, a local file or a Hub id), got "
                             f"{self.dataset_name!r}.")
        if self.output_dir and os.path.exists(self.output_dir) and not os.path.isdir(self.output_dir):
            raise ValueError(f"output_dir {self.output_dir!r} is a file, not a folder: pass a folder for the results "
                             "(or '' to write none).")
        self.chat_template_kwargs = check_chat_template_kwargs(self.chat_template_kwargs)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}.")
        if self.device is not None:
            _check_device(self.device)
        if not (math.isfinite(self.code_timeout) and self.code_timeout > 0):
            raise ValueError(f"code_timeout must be a finite number of seconds > 0, got {self.code_timeout}.")
        for name in ("code_memory_mb", "code_max_output_bytes", "code_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        negative = [i for i in self.stop_token_ids or [] if i < 0]
        if negative:
            raise ValueError(f"stop_token_ids must all be >= 0, got {negative} in {self.stop_token_ids}.")
        # generation values that no model takes: refused here, not after the model has loaded
        if self.use_cache is not None:
            _cache_setting(self.use_cache)
        if self.remasking_strategy is not None and self.remasking_strategy not in REMASKING_STRATEGIES:
            raise ValueError(f"remasking_strategy must be one of {REMASKING_STRATEGIES}, got "
                             f"{self.remasking_strategy!r}.")
        if self.cuda_graphs is not None:
            check_cuda_graphs("cuda_graphs", self.cuda_graphs)

    def generate_kwargs(self, dataset_tag: str | None = None) -> dict[str, Any]:
        """The ``model.generate`` arguments that were set (dataset defaults fill the rest for ``arithmetic``)."""
        kwargs = {name: getattr(self, name) for name in _GENERATE_FIELDS if getattr(self, name) is not None}
        if "use_cache" in kwargs:
            kwargs["use_cache"] = _cache_setting(kwargs["use_cache"])
        return {**_DATASET_GENERATION_DEFAULTS.get(dataset_tag or "", {}), **kwargs}

    def math_reward(self) -> MathAccuracyReward | OfficialMathReward:
        """The reward that scores math completions (``math_grader``); raises for an unknown grader."""
        if self.math_grader not in MATH_GRADERS:
            raise ValueError(f"math_grader must be one of {list(MATH_GRADERS)}, got {self.math_grader!r}.")
        if self.math_grader == "official":
            return OfficialMathReward()
        return MathAccuracyReward(answer_rules=self.math_grader == "math_verify")

    def check_code_grader(self) -> None:
        """Raise for an unknown ``code_grader``."""
        if self.code_grader not in CODE_GRADERS:
            raise ValueError(f"code_grader must be one of {list(CODE_GRADERS)}, got {self.code_grader!r}.")

    def resolved_pass_k(self) -> list[int]:
        """The k values to report; raises if one is outside ``[1, num_samples]``."""
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}.")
        ks = sorted(set(self.pass_k or {1, self.num_samples}))
        bad = [k for k in ks if not 1 <= k <= self.num_samples]
        if bad:
            raise ValueError(f"pass@k needs 1 <= k <= num_samples ({self.num_samples}); got k={bad}.")
        return ks


def _cache_setting(value: Any) -> bool | str:
    """``generate``'s ``use_cache`` for an ``EvalConfig.use_cache`` value (a bool, or its command-line string)."""
    key = str(value).lower()
    if key not in _CACHE_VALUES:
        raise ValueError(f"use_cache must be one of {sorted(_CACHE_VALUES)}, got {value!r}.")
    return _CACHE_VALUES[key]


def _check_device(device: str) -> None:
    """Raise a ValueError unless ``device`` parses as a ``torch.device`` (e.g. ``cpu``, ``cuda``, ``cuda:1``)."""
    try:
        torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(f"device must be a torch device such as 'cpu', 'cuda' or 'cuda:0', got {device!r} "
                         f"({error}).") from None


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: ``1 - C(n-c, k) / C(n, k)`` (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}.")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# --------------------------------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------------------------------

def score_completions(
    problems: list[EvalProblem],
    completions: list[str],
    limits: SandboxLimits | None = None,
    workers: int = 4,
    math_reward: MathAccuracyReward | OfficialMathReward | None = None,
    code_grader: str = "sandbox",
) -> list[dict[str, Any]]:
    """Score ``completions[i]`` against ``problems[i]``. Each result has ``reward`` (1.0 / 0.0, or ``None`` when
    the gold answer cannot be parsed) and details: ``prediction`` (math: the last boxed answer as ``math_reward``
    reads it; default :class:`MathAccuracyReward`) or ``tests_passed`` / ``tests_total`` / ``status`` / ``errors``
    (code), scored by ``code_grader`` (``EvalConfig.code_grader``)."""
    if code_grader not in CODE_GRADERS:
        raise ValueError(f"code_grader must be one of {list(CODE_GRADERS)}, got {code_grader!r}.")
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions.")
    results: list[dict[str, Any]] = [{} for _ in problems]
    math_idx = [i for i, p in enumerate(problems) if p.task == "math"]
    code_idx = [i for i, p in enumerate(problems) if p.task == "code"]
    if math_idx:
        reward = math_reward or MathAccuracyReward()
        scores = reward([completions[i] for i in math_idx], answer=[problems[i].answer for i in math_idx])
        boxed = extract_boxed_answer if isinstance(reward, OfficialMathReward) else last_boxed_content
        for i, score in zip(math_idx, scores):
            pred = boxed(completions[i])
            results[i] = {"reward": score, "gold": problems[i].answer, "prediction": pred}
    if code_idx:
        limits = limits or SandboxLimits()
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(code_idx)))) as pool:
            scored = pool.map(lambda i: _score_code(problems[i], completions[i], limits, code_grader), code_idx)
            for i, result in zip(code_idx, scored):
                results[i] = result
    return results


def _score_code(problem: EvalProblem, completion: str, limits: SandboxLimits, grader: str) -> dict[str, Any]:
    """Run the code of ``response_prefix`` + completion (the last Python block, as ``grader`` reads it) and the
    tests in the sandbox; a function problem's ``header`` goes before the code when the two parse together, then
    its ``prefix``."""
    text = problem.response_prefix + completion
    code = extract_code_official(text) if grader == "official" else extract_code(text)
    if code is None:
        return {"reward": 0.0, "status": "no_code", "tests_passed": 0, "tests_total": len(problem.tests), "errors": []}
    if problem.stdio:
        program = official_stdio_program(code) if grader == "official" else stdio_program(code)
    else:
        code = _after_header(problem.header, code)
        program = f"{problem.prefix}\n{code}" if problem.prefix else code
    if grader == "official":
        result = run_official(program, problem.tests, problem.stdio, problem.time_limit, limits)
    else:
        result = run_tests(program, problem.tests, limits)
    return {"reward": float(result.all_passed), "status": result.status, "tests_passed": result.passed,
            "tests_total": result.total, "tests_verified": result.verified, "errors": result.errors[:3]}


def _after_header(header: str, code: str) -> str:
    """``header`` + ``code`` when they parse together (the code continues the header, e.g. the function's body),
    else ``code`` alone (it restates the header, e.g. the whole function, which after a bare ``def`` line would be a
    syntax error). Only parsed here, never run: the sandbox runs the program."""
    if not header:
        return code
    joined = header + code if header.endswith("\n") else f"{header}\n{code}"
    try:
        ast.parse(joined)
    except (SyntaxError, ValueError, MemoryError, RecursionError):  # ValueError: a null byte
        return code
    return joined


# --------------------------------------------------------------------------------------------------------------------
# Model, prompts, generation
# --------------------------------------------------------------------------------------------------------------------


def load_model_and_tokenizer(config: EvalConfig, launch_device: torch.device | None = None) -> tuple[Any, Any]:
    """Load the model (``AutoModelForCausalLM``; families registered by ``import trl_diffusion``) and tokenizer;
    the embedded model when none is named. A path that names no directory fails before anything is loaded.
    ``launch_device``: the device a launch gives this process (its own GPU), used unless ``config.device`` is
    ``cpu``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..assets import resolve_model_path

    path = resolve_model_path(config.model_name_or_path)
    tokenizer_path = resolve_model_path(config.tokenizer_name_or_path) if config.tokenizer_name_or_path else path
    if launch_device is not None and (config.device is None or torch.device(config.device).type != "cpu"):
        device = launch_device
    else:
        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    if config.fused_kernels:
        set_fused_kernels(model)
    return model.to(device).eval(), tokenizer


@contextlib.contextmanager
def loading_bars(shown: bool):
    """transformers' progress bars (its "Loading weights" bar) off for the block unless ``shown`` (``--progress
    false``, or a process of a launch other than the first), as they were after it."""
    from transformers.utils import logging as transformers_logging

    enabled = transformers_logging.is_progress_bar_enabled()
    if enabled and not shown:
        transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled and not shown:
            transformers_logging.enable_progress_bar()


def check_before_loading(config: EvalConfig, loads_model: bool = True) -> None:
    """What an evaluation checks of its settings before it loads anything (here, and before ``trl-diffusion eval``
    launches its processes): the model and tokenizer it will load (``loads_model``, :func:`_check_loadable`), the
    ``pass_k`` values, the graders, a positive ``max_problems`` and an ``output_dir`` for ``resume``."""
    if loads_model:
        _check_loadable(config)
    config.resolved_pass_k()
    config.math_reward()  # an unknown grader fails before the model loads
    config.check_code_grader()
    if config.max_problems is not None and config.max_problems <= 0:  # rows given directly skip the loader's check
        raise ValueError(f"max_problems must be positive, got {config.max_problems}.")
    if config.resume and not config.output_dir:
        raise ValueError("resume reads the samples an interrupted run wrote to output_dir: set --output_dir.")


def _check_loadable(config: EvalConfig) -> None:
    """What :func:`load_model_and_tokenizer` will need, checked before the dataset loads: the model and tokenizer
    (a path must be a directory holding a model, ``check_model_folder``, and not a saved value model's:
    :func:`_check_not_value_model`; a Hub id must be cached while the Hub is offline) and a CUDA ``device`` that
    exists here."""
    from ..assets import check_hub_model_cached, check_model_folder, resolve_model_path

    for name, file_name in ((config.model_name_or_path, "config.json"),
                            (config.tokenizer_name_or_path, "tokenizer_config.json")):
        if name:
            check_hub_model_cached(resolve_model_path(name), file_name=file_name)
    if config.model_name_or_path:
        path = resolve_model_path(config.model_name_or_path)
        check_model_folder(path)
        _check_not_value_model(config.model_name_or_path, path)
    device = torch.device(config.device) if config.device else None
    if device is not None and device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r}: CUDA is not available here (torch {torch.__version__}, "
                             f"{torch.cuda.device_count()} GPUs visible); pass --device cpu or leave it unset.")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {config.device!r}: only {torch.cuda.device_count()} CUDA device(s) are "
                             "visible here.")


VALUE_MODEL_ARCHITECTURE = "DiffusionValueModel"
"""The ``architectures`` entry of a saved :class:`~trl_diffusion.value.DiffusionValueModel`'s ``config.json``."""


def _check_not_value_model(name: str, path: str) -> None:
    """Refuse, before anything loads, a local folder holding a saved value model (its ``config.json`` lists
    :data:`VALUE_MODEL_ARCHITECTURE`: what TraceRL saves in ``<output_dir>/value_model`` and in its checkpoints): a
    critic trained beside the policy, a backbone with a scalar head and no language-model head, which generates
    nothing (loading it failed on its missing tokenizer, or on its keys). ``path``: ``name`` as resolved; a Hub id
    is not read (offline it could not be)."""
    folder = Path(os.path.expanduser(path))
    try:
        architectures = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):  # no file, not JSON, not an object: left to the loader
        return
    if VALUE_MODEL_ARCHITECTURE not in architectures:
        return
    parent = folder.resolve().parent
    policy = f" ({parent} holds it)" if (parent / "config.json").is_file() else ""
    raise ValueError(f"{name} is a value model (config.json architectures {architectures}): the critic TraceRL "
                     "trains beside the policy to score its states, not a language model to evaluate. Evaluate the "
                     f"policy: pass --model_name_or_path the run's output_dir or checkpoint folder{policy}.")


def _warn_other_family_preset(prompt_template: str | None, model_type: str) -> None:
    """Warn when a ``dllm_rl_*`` prompt preset written for another family's chat markup is used on this model (its
    markup reaches the model as plain text)."""
    families = PRESET_MODEL_TYPES.get(prompt_template or "")
    if families is not None and model_type not in families:
        own = [name for name, types in PRESET_MODEL_TYPES.items() if model_type in types]
        logger.warning("prompt_template %r is dLLM-RL's prompt for %s models, with their chat markup, but the model "
                       "is a %s model%s.", prompt_template, " / ".join(families), model_type,
                       f": its preset is {' or '.join(own)}" if own else "")


def _messages(tokenizer: Any, problem: EvalProblem, config: EvalConfig) -> list[dict[str, str]]:
    """The chat of a problem: the optional system message and the user turn."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template; pass --apply_chat_template false for a base model.")
    messages = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
    return [*messages, {"role": "user", "content": problem.prompt}]


def format_prompt(tokenizer: Any, problem: EvalProblem, config: EvalConfig) -> str:
    """The text fed to the model (recorded in the samples rows): the chat template with a generation prompt (or the
    raw prompt)."""
    if not config.apply_chat_template:
        text = problem.prompt
    else:
        # sanitize_control_tokens changes how the text tokenizes (tokenize_prompt), not the text; transformers refuses
        # it without tokenize=True
        kwargs = {k: v for k, v in (config.chat_template_kwargs or {}).items() if k != "sanitize_control_tokens"}
        text = tokenizer.apply_chat_template(_messages(tokenizer, problem, config), tokenize=False,
                                             add_generation_prompt=True, **kwargs)
    return text + "<think>" if config.start_with_think else text


def tokenize_prompt(tokenizer: Any, problem: EvalProblem, config: EvalConfig) -> list[int]:
    """The token ids of :func:`format_prompt`'s text, as TRL's GRPOTrainer tokenizes prompts: a plain prompt with
    the tokenizer's special tokens (e.g. BOS); a chat prompt by ``apply_chat_template(tokenize=True)``, which adds
    none and takes every ``chat_template_kwargs`` (``sanitize_control_tokens`` too)."""
    if not config.apply_chat_template:
        return tokenizer(format_prompt(tokenizer, problem, config))["input_ids"]
    kwargs = config.chat_template_kwargs or {}
    think_id = tokenizer.get_added_vocab().get("<think>") if config.start_with_think else None
    if config.start_with_think and think_id is None:
        # an ordinary "<think>" merges with the template's last characters: the text is tokenized whole
        if kwargs.get("sanitize_control_tokens"):
            raise ValueError("start_with_think with sanitize_control_tokens needs '<think>' as an added token of the "
                             "tokenizer (this one splits it into ordinary pieces, which the rendered text's end can "
                             "merge into): drop one of them.")
        return tokenizer(format_prompt(tokenizer, problem, config), add_special_tokens=False)["input_ids"]
    ids = tokenizer.apply_chat_template(_messages(tokenizer, problem, config), tokenize=True, return_dict=True,
                                        add_generation_prompt=True, **kwargs)["input_ids"]
    # an added <think> (Qwen3, SDAR / TraDo templates open with it) is one token whatever precedes it
    return [*ids, think_id] if think_id is not None else list(ids)


def _completion(tokenizer: Any, tokens: list[int], committed: list[bool], stop_ids: set[int]) -> tuple[str, int, bool]:
    """Decode up to the first committed stop or special token; return (text, length in tokens, whether it ran out of
    room: no stop token anywhere in the row's canvas, so the answer may be cut off). Only committed positions count:
    generate() right-pads a row whose completion region is narrower than the batch's widest (block models round
    each row up to its own block end) with the pad token, which is no stop the model chose."""
    end = next((i for i, (t, c) in enumerate(zip(tokens, committed)) if c and t in stop_ids), None)
    if end is None:  # no stop: the row filled its whole region, which is every committed position
        end = sum(committed)
        return tokenizer.decode(tokens[:end]), end, True
    return tokenizer.decode(tokens[:end]), end, False


# --------------------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------------------


LOAD_SETTINGS = ("tokenizer_name_or_path", "dtype", "device", "fused_kernels")
"""``EvalConfig`` fields that :func:`load_model_and_tokenizer` alone reads."""


def _check_load_settings_unset(config: EvalConfig) -> None:
    """Refuse :data:`LOAD_SETTINGS` set for a model passed to :func:`evaluate` in memory: they apply when it loads
    the model, and were ignored without a word (``dtype="float16"`` left float32 weights, ``device="cuda:3"`` ran
    where the model was)."""
    defaults = {field.name: field.default for field in dataclasses.fields(EvalConfig)}
    given = [f"{name}={getattr(config, name)!r}" for name in LOAD_SETTINGS if getattr(config, name) != defaults[name]]
    if given:
        raise ValueError(f"{', '.join(given)}: loading settings, which apply when evaluate() loads the model "
                         "(model_name_or_path), not to a model passed in: convert and place it yourself "
                         "(model.to(dtype, device), trl_diffusion.set_fused_kernels) and pass its tokenizer as "
                         "tokenizer=.")


def evaluate(
    config: EvalConfig | None = None,
    *,
    model: Any = None,
    tokenizer: Any = None,
    dataset: Any = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Evaluate a diffusion model on a benchmark; return the report (also written to ``output_dir``).

    ``config`` fields can be overridden by keyword (``evaluate(dataset="gsm8k", num_samples=4)``). ``model`` is a
    loaded model or a path; ``tokenizer`` goes with a loaded model. ``dataset`` is a name / path (as
    ``EvalConfig.dataset_name``), a list of :class:`EvalProblem`, or rows (``datasets.Dataset``, ``pandas.DataFrame``,
    a list of dicts, or a stream: ``datasets.IterableDataset``, of which only the first ``max_problems`` rows are
    read) in a known format; only the first ``max_problems`` rows are converted (checked), as of a file. Report keys:
    ``model``, ``dataset``, ``task``, ``num_problems``, ``num_samples``, ``metrics`` (``accuracy``, ``pass@k``...,
    ``avg_length``, ``clipped_ratio``, ``tokens_per_step``, ``throughput_tokens_per_s``, ``generation_seconds``,
    ``num_forward_passes``, ``num_unscored``, ``boxed_rate`` for math), ``generation`` (the resolved sampler
    settings), ``samples_file``, ``metrics_file``, ``num_processes``.

    Under ``accelerate launch`` / ``torchrun`` the processes share the samples (each on its own device, with its own
    copy of the model) and every process returns the same report; the main process writes the files.
    """
    config = dataclasses.replace(config or EvalConfig(), **_split_overrides(overrides, model, dataset))
    check_launch_device(config.device, launch_world_size())
    check_before_loading(config, loads_model=model is None or isinstance(model, (str, Path)))
    ks = config.resolved_pass_k()
    chat_by_default = config.apply_chat_template is None
    config = dataclasses.replace(config, apply_chat_template=_resolve_chat_template(config, model))
    tag, problems, rows_source = _problems(config, dataset)
    # the built-in task's own settings: not for a file or rows that happen to be tagged "arithmetic"
    by_name = dataset is None or isinstance(dataset, (str, Path))  # else rows or problems given directly
    builtin = tag if by_name and config.dataset_name.strip().lower() == "arithmetic" else None
    if config.batch_size is None:
        config = dataclasses.replace(config, batch_size=_DATASET_BATCH_SIZE.get(builtin, _BATCH_SIZE))
    if config.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {config.batch_size}.")
    in_memory = not (model is None or isinstance(model, (str, Path)))
    if in_memory:
        _check_load_settings_unset(config)
    processes = EvalProcesses.from_launch()
    if not in_memory:
        with loading_bars(config.progress and processes.is_main):
            model, loaded_tokenizer = load_model_and_tokenizer(config, processes.device)
        tokenizer = loaded_tokenizer if tokenizer is None else tokenizer
    if tokenizer is None:
        raise ValueError("a loaded model needs its tokenizer: pass tokenizer=...")
    generate_kwargs = config.generate_kwargs(builtin)
    settings = _check_model(model, tokenizer, generate_kwargs)
    if _length_unset(model, generate_kwargs) and processes.is_main:
        logger.warning(LENGTH_HINT, settings.max_new_tokens)
    if processes.is_main:
        _warn_other_family_preset(config.prompt_template, model.config.model_type)
    if config.num_samples > 1 and _deterministic(settings) and processes.is_main:
        logger.warning("num_samples=%d with greedy decoding: every sample of a problem will be the same.",
                       config.num_samples)
    model_name = str(config.model_name_or_path or getattr(model, "name_or_path", "") or "model")
    dataset_name = config.dataset_name if by_name else "custom"
    samples_path = _output_path(config.output_dir, model_name, tag)
    weights = _weights_digest(model) if in_memory or samples_path is not None else None  # for sources / run card
    model_source = _in_memory_source(model, model_name, weights) if in_memory else _source(model_name)
    sources = {"model": model_source, "dataset": _dataset_source(config) if by_name else rows_source}
    prepared = _prepare(model, tokenizer, problems, config, settings)
    card = None if samples_path is None else run_card(config, sources, settings, _loaded(model, tokenizer, weights),
                                                      resolved=_GENERATE_FIELDS)
    launched = processes.world_size > 1
    with contextlib.ExitStack() as held:

        def claim() -> list[dict[str, Any]]:  # the output files: locked until the metrics are written
            held.enter_context(_output_lock(samples_path))
            _check_output_free(samples_path, sources)
            if not config.resume:
                return []
            rows = resumed_rows(samples_path, card, prepared.prompts, prepared.digests, config.num_samples)
            if not rows:  # a requeued job runs the same command the first time too: not an error, but said
                _log_nothing_resumed(samples_path)
            return rows

        kept = processes.on_main(claim)
        done = _check_launch_agrees(processes, model_source, problems, kept)
        if launched and samples_path is not None:
            # the earlier run's files go only now, once every process has agreed to run; and no process opens its
            # part file before the old ones are gone (on_main returns once the main process is done)
            processes.on_main(lambda: start_files(samples_path, card, kept).close())
        stream = _row_stream(samples_path, card, kept, processes)
        new_rows, seconds, forward_passes = _run_everywhere(processes, functools.partial(
            _run, model, tokenizer, prepared, config, tag, stream, generate_kwargs, processes, done))

        def report() -> dict[str, Any]:
            rows = sorted(kept + new_rows, key=lambda r: (r["index"], r["sample"]))
            if samples_path is not None and (launched or not new_rows):  # the parts merged, or nothing generated
                start_files(samples_path, card, rows).close()  # (a single process's first batch began the file)
            result = {
                "model": model_name,
                "dataset": tag,
                "dataset_name": dataset_name,
                "sources": sources,
                "task": problems[0].task,
                "num_problems": len(problems),
                "num_samples": config.num_samples,
                "apply_chat_template": config.apply_chat_template,
                "chat_template_kwargs": config.chat_template_kwargs,
                "math_grader": config.math_grader if problems[0].task == "math" else None,
                "code_grader": config.code_grader if problems[0].task == "code" else None,
                "metrics": _metrics(rows, problems, config.num_samples, ks),
                "generation": {k: list(v) if isinstance(v, tuple) else v
                               for k, v in dataclasses.asdict(settings).items()},
                "samples_file": str(samples_path) if samples_path else None,
                "metrics_file": None,
                "num_processes": processes.world_size,
                "num_resumed": len(kept),
            }
            result["metrics"].update(_speed(rows, new_rows, seconds, forward_passes))
            if chat_by_default and config.apply_chat_template and _all_wrong(result["metrics"]):
                logger.warning(PLAIN_PROMPT_HINT)
            if samples_path is not None:
                metrics_path = samples_path.with_suffix(".metrics.json")
                result["metrics_file"] = str(metrics_path)
                partial = metrics_path.with_name(metrics_path.name + ".tmp")  # whole, then renamed: never half a file
                partial.write_text(json.dumps(result, indent=2) + "\n")
                os.replace(partial, metrics_path)
            return result

        return processes.on_main(report)


@dataclass(frozen=True)
class PreparedProblems:
    """The problems as a run feeds them to the model: prompt texts, prompt token ids, and each problem's digest
    (:func:`~trl_diffusion.eval.resume.problem_digest`, stored in its rows)."""

    problems: list[EvalProblem]
    prompts: list[str]
    token_ids: list[list[int]]
    digests: list[str]


def _prepare(model: Any, tokenizer: Any, problems: list[EvalProblem], config: EvalConfig,
             settings: Any) -> PreparedProblems:
    """Format and tokenize every prompt, and raise, naming the problems, for what ``generate`` or the official
    grader would refuse mid-run (a prompt holding the mask token, one too long for the model, an official time
    limit that is no number of seconds): before any process replaces an earlier run's files."""
    prompts = [format_prompt(tokenizer, p, config) for p in problems]
    token_ids = [tokenize_prompt(tokenizer, p, config) for p in problems]
    _check_no_mask_token(model.mask_token_id, tokenizer.mask_token, problems, token_ids, config.apply_chat_template)
    _check_prompts_fit(model, settings, problems, token_ids)
    if config.code_grader == "official":
        _check_official_time_limits(problems)
    return PreparedProblems(problems, prompts, token_ids, [problem_digest(p) for p in problems])


def _loaded(model: Any, tokenizer: Any, weights: str) -> dict[str, Any]:
    """What the run card records of the loaded objects and the code: the ``weights`` digest (a checkpoint folder
    saved again in place keeps its path), the tokenizer (where from, its class and size), the weights' dtype and
    the kind of device (``auto`` resolves to bfloat16 on a GPU, float32 on a CPU, and a generator draws differently
    on each), and this package's version (its sampler draws the samples)."""
    from .. import __version__

    parameter = next(model.parameters())
    name = str(getattr(tokenizer, "name_or_path", "") or "")
    return {"weights": weights, "tokenizer": [_source(name) if name else None, type(tokenizer).__name__,
                                              len(tokenizer)],
            "dtype": str(parameter.dtype), "device": parameter.device.type, "trl_diffusion": __version__}


def _log_nothing_resumed(samples_path: Path) -> None:
    """Say that ``--resume`` found no sample to keep in the samples file's folder, so the run generates them all."""
    found = [path.name for path in (samples_path, *part_paths(samples_path)) if path.is_file()]
    why = (f"{', '.join(found)} holds no sample of this evaluation" if found
           else f"no {samples_path.name} there")
    logger.warning("--resume: nothing was found to resume in %s (%s), so the evaluation starts from the first "
                   "sample.", samples_path.parent, why)


def _run_everywhere(processes: EvalProcesses,
                    run_here: Callable[[], tuple[list[dict[str, Any]], float, int]]) -> tuple[list[dict], float, int]:
    """``run_here()`` (this process's :func:`_run`) on every process of a launch, the results merged
    (:func:`merge_runs`) on every process. An error on one process is raised on all of them (the others would wait
    for its rows): as it is there, elsewhere as a ValueError (for one) or RuntimeError naming the process."""
    if processes.world_size == 1:
        return run_here()
    failure = None
    try:
        run = run_here()
    except Exception as error:  # an out-of-memory error too: the others must hear of it
        failure, run = error, ([], 0.0, 0)
    text = None if failure is None else (type(failure).__name__, describe(failure))
    parts = processes.gather((run, text))
    if failure is not None:
        raise failure
    failed = [(rank, said) for rank, (_, said) in enumerate(parts) if said is not None]
    if failed:
        rank, (kind, message) = failed[0]
        raise shared_error(rank, kind, message)
    return merge_runs([part for part, _ in parts])


def _row_stream(samples_path: Path | None, card: dict[str, Any], kept: list[dict[str, Any]],
                processes: EvalProcesses) -> Callable[[], IO[str]] | None:
    """What opens, when the first batch is scored, the file this process streams its rows to: a single process's
    samples file, begun with the ``kept`` rows of a resume (so a run that fails before leaves an earlier run's
    files as they were), or under a launch this process's part file (the main process merges the parts)."""
    if samples_path is None:
        return None
    if processes.world_size == 1:
        return functools.partial(start_files, samples_path, card, kept)
    return functools.partial(part_path(samples_path, processes.rank).open, "w", encoding="utf-8")


def _check_launch_agrees(processes: EvalProcesses, model_source: str, problems: list[EvalProblem],
                         kept: list[dict[str, Any]]) -> set[tuple[int, int]]:
    """Before any generation, on every process of a launch: raise if the processes evaluate different models or
    problems (on every process, so none is left waiting for the others). Returns the (problem, sample) keys of the
    main process's ``kept`` rows (a resume's; shared with every process by ``on_main``), which no process generates
    again."""
    if processes.world_size > 1:
        check_same_inputs(processes.gather({"model": model_source, "problems": _rows_source(problems)}))
    return {(row["index"], row["sample"]) for row in kept}


PLAIN_PROMPT_HINT = (
    "every sample scored 0 with the prompts in the tokenizer's chat template, the default for every model but the "
    "embedded one and those trained from it. A model trained on plain prompts (a base model, or one fine-tuned "
    "without the chat template) needs --apply_chat_template false.")
"""Logged when an evaluation that chose the chat template by default scores nothing."""


LENGTH_HINT = (
    "max_new_tokens is set neither here nor in the model's generation_config.json: every completion gets the "
    "family default of %d new tokens, which cuts reasoning short (metrics['clipped_ratio'] counts the completions "
    "that ran out of room). Pass --max_new_tokens: dLLM-RL evaluates TraDo / SDAR with 2000, LLaDA and Dream with "
    "1024 (their eval configs).")
"""Logged before an evaluation whose generation length nobody chose."""


def _length_unset(model: Any, generate_kwargs: dict) -> bool:
    """Whether neither the call nor the model's ``generation_config`` sets ``max_new_tokens`` (a config's
    ``max_length`` alone is refused by :func:`_check_model`), so ``generate`` falls back to the family default."""
    config = getattr(model, "generation_config", None)
    return generate_kwargs.get("max_new_tokens") is None and getattr(config, "max_new_tokens", None) is None


def _all_wrong(metrics: dict[str, Any]) -> bool:
    return metrics.get("num_scored", 0) > 0 and metrics.get("accuracy") == 0.0


_OLD_NAMES = {"dataset_split": "dataset_test_split"}
"""Earlier keyword names :func:`evaluate` still accepts (the command line takes them as aliases)."""


def _split_overrides(overrides: dict, model: Any, dataset: Any) -> dict:
    overrides = {_OLD_NAMES.get(k, k): v for k, v in overrides.items()}
    names = {f.name for f in dataclasses.fields(EvalConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(f"evaluate() got unknown arguments {unknown}; EvalConfig fields are {sorted(names)}.")
    if isinstance(model, (str, Path)):
        overrides["model_name_or_path"] = str(model)
    if isinstance(dataset, (str, Path)):
        overrides["dataset_name"] = str(dataset)
    return overrides


def _resolve_chat_template(config: EvalConfig, model: Any) -> bool:
    """``apply_chat_template`` as set, else the model's own prompt format: plain prompts for the embedded model and
    the models trained from it (``trl_diffusion.assets.EMBEDDED_FORMAT``, ``is_embedded_model``) and for a
    :data:`PROMPT_PRESETS` prompt (a whole prompt), the chat template for every other model."""
    from ..assets import EMBEDDED_CHAT_TEMPLATE, is_embedded_model

    chat = config.apply_chat_template
    if config.prompt_template in PROMPT_PRESETS:
        if chat:
            raise ValueError(f"prompt_template={config.prompt_template!r} is a whole prompt (chat markup included), "
                             "so it cannot go through the chat template: leave apply_chat_template unset or false.")
        if config.start_with_think:
            raise ValueError(f"start_with_think adds <think> to the chat template's prompt, which "
                             f"prompt_template={config.prompt_template!r} does not go through: drop start_with_think "
                             "(dLLM-RL's thinking prompt, with its own instruction, is prompt_template="
                             "'dllm_rl_sdar_think').")
        chat = False
    if chat is None:
        if model is None or isinstance(model, (str, Path)):
            embedded = not config.model_name_or_path or is_embedded_model(config.model_name_or_path)
        else:
            embedded = is_embedded_model(getattr(model, "config", None))
        chat = EMBEDDED_CHAT_TEMPLATE if embedded else True
    why = "" if config.apply_chat_template is not None else " (the default for the embedded model and the models " \
        "trained from it: plain prompts)"
    for name, other_fix in (("system_prompt", ", or put the text in --prompt_template"), ("chat_template_kwargs", "")):
        if getattr(config, name) and not chat:
            raise ValueError(f"{name} needs the chat template, but apply_chat_template is false{why}; pass "
                             f"--apply_chat_template true{other_fix}.")
    return bool(chat)


def _problems(config: EvalConfig, dataset: Any) -> tuple[str, list[EvalProblem], str | None]:
    """``(tag, problems, source)``: ``source`` identifies rows given directly (``_rows_source``), None by name."""
    if dataset is None or isinstance(dataset, (str, Path)):
        return (*load_eval_problems(config.dataset_name, config.dataset_config, config.dataset_test_split,
                                    config.max_problems, config.prompt_template, config.apply_chat_template), None)
    selectors = [f"{name}={getattr(config, name)!r}" for name in ("dataset_config", "dataset_test_split")
                 if getattr(config, name) is not None]
    if selectors:  # they were ignored: the rows given are what is evaluated
        these, them = ("these select", "them") if len(selectors) > 1 else ("it selects", "it")
        raise ValueError(f"{', '.join(selectors)}: {these} within a dataset evaluate() loads by name "
                         "(dataset_name), and the rows passed as dataset= are evaluated as they are: leave "
                         f"{them} unset, or pass the split's rows.")
    if isinstance(dataset, Mapping):  # iterating one would give its keys: split or column names
        raise TypeError(f"dataset must be rows (a datasets.Dataset, IterableDataset or pandas.DataFrame, a list "
                        f"or generator of dicts or EvalProblems), got a {type(dataset).__name__} with keys "
                        f"{sorted(map(str, dataset))[:8]}: "
                        "pass one split (dataset['test']) of a DatasetDict, or datasets.Dataset.from_dict(columns) "
                        "for columns.")
    pandas = sys.modules.get("pandas")  # a DataFrame exists only once pandas is imported
    if pandas is not None and isinstance(dataset, pandas.DataFrame):
        # its rows (iterating one gives its column names), with list cells as lists: a frame read from parquet holds
        # them as numpy arrays, which the format readers test for truth (`row.get("test_imports") or []`)
        # (a missing value is NaN in a frame, None in a list of rows)
        rows = [{key: _frame_cell(value) for key, value in row.items()} for row in dataset.to_dict("records")]
    else:
        rows = _read_rows(dataset, config.max_problems)
    kept = rows[: config.max_problems]  # as the file loader: only the problems evaluated are converted (checked)
    if kept and isinstance(kept[0], EvalProblem) and config.prompt_template is not None:
        raise ValueError(f"prompt_template={config.prompt_template!r} builds prompts from rows' questions, but an "
                         "EvalProblem's prompt is used as it is (the user turn, instruction included): format the "
                         "prompts yourself, or pass rows (dicts with a question column).")
    problems = kept if kept and isinstance(kept[0], EvalProblem) else problems_from_rows(kept, config.prompt_template)
    if not problems:
        raise ValueError("the dataset has no problems.")
    return "custom", problems, _rows_source(rows)


def _read_rows(dataset: Iterable, max_problems: int | None) -> list:
    """The rows of ``dataset`` that eval reads: every row of a sized one (a list, a ``datasets.Dataset``), whose
    digest identifies it whatever ``max_problems`` is (``_rows_source``); only the first ``max_problems`` of a stream
    (a ``datasets.IterableDataset``, a generator), which may be unbounded or a Hub dataset read over the network, and
    which therefore is identified by the rows read."""
    if isinstance(dataset, Sized):
        return list(dataset)
    return list(itertools.islice(dataset, max_problems))


def _frame_cell(value: Any) -> Any:
    """A DataFrame cell as a list of rows holds it: arrays as lists, a missing value (NaN, None, NaT) as None."""
    if hasattr(value, "ndim") and value.ndim > 0:
        return value.tolist()
    try:
        return None if value is None or value != value else value  # NaN and NaT differ from themselves
    except (TypeError, ValueError):  # a value with no boolean comparison is kept as it is
        return value


def _check_model(model: Any, tokenizer: Any, generate_kwargs: dict) -> Any:
    """Raise early for a model without diffusion ``generate`` or with bad generation settings."""
    from ..generation import DiffusionGenerationMixin
    from ..models import check_tokenizer

    if not isinstance(model, DiffusionGenerationMixin):
        raise ValueError(f"{type(model).__name__} is not a trl_diffusion model (SDAR / LLaDA / Dream).")
    check_tokenizer(tokenizer, model)
    if generate_kwargs.get("use_cache") is True and model.block_size is None:
        # generate() reads True on a full-attention model as no cache (a generation config's default); asked for on
        # the command line it would silently evaluate uncached
        raise ValueError(f"use_cache=true is the exact KV cache of block models (SDAR / TraDo); "
                         f"{type(model).__name__} has full attention and no exact cache. Pass --use_cache prefix "
                         "or dual (the approximate LLaDA / Dream caches), false, or leave it out.")
    config = getattr(model, "generation_config", None)
    if (generate_kwargs.get("max_new_tokens") is None and getattr(config, "max_new_tokens", None) is None
            and getattr(config, "max_length", None) is not None):
        # transformers' max_length counts the prompt columns, which in a left-padded batch are the longest prompt's:
        # a completion's budget (so its score) would depend on --batch_size and on the prompts it is batched with
        raise ValueError(f"the model's generation_config sets max_length ({config.max_length}) and no "
                         "max_new_tokens: in a batch, max_length less the batch's padded prompt width would be each "
                         "completion's budget, so results would depend on --batch_size. Pass --max_new_tokens.")
    settings, _ = model._resolve_settings(dict(generate_kwargs))
    settings.validate()
    return settings


def _deterministic(settings: Any) -> bool:
    """Whether every sample of a prompt decodes the same: no random commit rule (``random``, Dream's ``origin``,
    ``alg_temp``) and no token sampling (temperature 0, or top-k 1, which keeps only the argmax)."""
    greedy = dataclasses.replace(settings, temperature=0.0) if settings.top_k == 1 else settings
    return not greedy.draws_randomness


def _output_path(output_dir: str | None, model_name: str, tag: str) -> Path | None:
    if not output_dir:
        return None
    model_tag = Path(model_name.rstrip("/")).name or "model"
    path = Path(output_dir) / f"{model_tag}__{tag}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _output_lock(samples_path: Path | None):
    """Hold the run's output files for the whole run: an exclusive ``fcntl.flock`` on a ``.lock`` file beside them
    (released however the process ends). A second evaluation into the same files (two runs started at once for two
    devices, into one ``--output_dir``) is refused: its rows were interleaved with this one's, spliced mid-line, and
    the metrics file described either run's rows. Where the file system has no ``flock`` the run goes on unlocked,
    with a warning."""
    if samples_path is None:
        yield
        return
    try:
        import fcntl  # POSIX only: the rest of the package imports on Windows
    except ImportError:
        logger.warning("no fcntl on this system: this evaluation runs without the check that no other one writes "
                       "%s.", samples_path)
        yield
        return
    lock_path = samples_path.with_suffix(".lock")
    with open(lock_path, "w") as handle:
        busy = ValueError(f"another evaluation is writing {samples_path} (it holds {lock_path}): let it finish, or "
                          "give this one another --output_dir.")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy from None
        except OSError as error:  # a file system without flock (Lustre without -o flock, NFS without lockd)
            logger.warning("cannot lock %s (%s): this evaluation runs without the check that no other one writes "
                           "the same files.", lock_path, error)
        else:  # the path may name a newer lock file by now (a finished run removes its own): ours must be it
            if not lock_path.exists() or os.stat(lock_path).st_ino != os.fstat(handle.fileno()).st_ino:
                raise busy
        try:
            yield
        finally:
            lock_path.unlink(missing_ok=True)


def _check_output_free(samples_path: Path | None, sources: dict[str, str]) -> None:
    """Refuse, before generating, to replace the results of another model or dataset that share the file name
    (``runA/checkpoint-100`` and ``runB/checkpoint-100``; ``a/test.jsonl`` and ``b/test.jsonl``; another split of a
    Hub dataset): an earlier run of the same ``sources`` (:func:`_source`, :func:`_dataset_source`) is replaced, as
    documented. The earlier run's sources are its report's, or, for a run that was interrupted (no report), its run
    card's. A report without ``sources`` (written before they were recorded) is replaced."""
    if samples_path is None:
        return
    metrics_path = samples_path.with_suffix(".metrics.json")
    record = metrics_path if metrics_path.is_file() else card_path(samples_path)
    if not record.is_file():
        return
    try:
        earlier = json.loads(record.read_text()).get("sources")
    except (OSError, ValueError, AttributeError):
        return  # not a file of ours: the run replaces it
    if earlier is not None and earlier != sources:
        raise ValueError(f"{record} holds the results of model {earlier.get('model')!r} on dataset "
                         f"{earlier.get('dataset')!r}, which this run ({sources['model']!r} on "
                         f"{sources['dataset']!r}) would replace (the file is named by the model's and the dataset's "
                         "last path components): pass another --output_dir.")


def _source(name: str) -> str:
    """A model or dataset name as eval identifies it: a local path resolved (the same folder from another working
    directory is the same), anything else as given."""
    path = Path(os.path.expanduser(name))
    return str(path.resolve()) if path.exists() else name


_INTEGER_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DIGEST_CHUNK = 1 << 22


def _in_memory_source(model: Any, name: str, weights: str | None = None) -> str:
    """A model given as an object, as eval identifies it: its class, name (a local path resolved, as
    :func:`_source`) and a digest of its weights and adapter state (``weights``: :func:`_weights_digest`, computed
    if not given), since a fine-tuned model keeps its base model's ``name_or_path`` (its results must not replace
    the base model's, nor another model's)."""
    return f"in-memory:{type(model).__name__}:{_source(name)}:{weights or _weights_digest(model)}"


def _weights_digest(model: Any) -> str:
    """A digest of a model's weights and adapter state. Per parameter: name, shape, dtype, and two integer sums of
    its bits (plain and position-weighted, in chunks: no float rounding, so no dependence on threads or devices, and
    no full-size copy; not collision-proof, but any training step changes them); per adapter layer (peft): which
    adapters are active, disabled or merged, and their scaling (LoRA's alpha / r, not a parameter). One pass over
    the weights (3.0 s for 0.45 GB of bf16 on 2 CPU cores)."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            digest.update(f"{parameter_name}{tuple(parameter.shape)}{parameter.dtype}".encode())
            if parameter.device.type == "meta" or parameter.numel() == 0:  # offloaded: no values here
                continue
            bits = parameter.detach().contiguous().view(_INTEGER_VIEWS.get(parameter.element_size(), torch.uint8))
            bits = bits.reshape(-1)
            plain = weighted = 0
            for start in range(0, bits.numel(), _DIGEST_CHUNK):
                chunk = bits[start: start + _DIGEST_CHUNK].to(torch.int64)
                weights = torch.arange(start, start + chunk.numel(), device=chunk.device) % 65521 + 1
                plain += int(chunk.sum())
                weighted += int((chunk * weights).sum())
            digest.update(f"{plain}:{weighted}".encode())
        for module_name, module in model.named_modules():
            adapters = getattr(module, "active_adapters", None)  # peft's tuner layers: a list (a model: a method)
            if adapters is not None and not callable(adapters):
                state = (module_name, adapters, getattr(module, "disable_adapters", None),
                         getattr(module, "merged_adapters", None), getattr(module, "scaling", None))
                digest.update(repr(state).encode())
    return digest.hexdigest()[:16]


def _dataset_source(config: EvalConfig) -> str:
    """The dataset an evaluation by name reads: a local file resolved, or a short name / Hub id (case-insensitive)
    with its ``dataset_config`` and ``dataset_test_split`` (other splits are other results)."""
    name = config.dataset_name.strip()
    if name.lower() == "arithmetic":
        return "arithmetic"
    if Path(os.path.expanduser(name)).is_file():
        return _source(name)
    return ":".join(str(part) for part in (name.lower(), config.dataset_config, config.dataset_test_split))


def _rows_source(rows: list) -> str:
    """Rows or problems given directly, identified by their content: ``custom:`` and a digest of every field of every
    row as given (before ``max_problems`` and ``prompt_template`` apply, which do not make another dataset, as for a
    file; a stream's rows are those read, its first ``max_problems``: :func:`_read_rows`), so another set of rows is
    another dataset (its results do not silently replace these)."""
    fields = [dataclasses.asdict(row) if isinstance(row, EvalProblem) else {str(k): v for k, v in row.items()}
              for row in rows]
    text = json.dumps(fields, sort_keys=True, ensure_ascii=False,
                      default=lambda value: value.tolist() if hasattr(value, "tolist") else repr(value))
    return "custom:" + hashlib.sha256(text.encode()).hexdigest()[:16]


@torch.no_grad()
def _run(model: Any, tokenizer: Any, prepared: PreparedProblems, config: EvalConfig, tag: str,
         stream: Callable[[], IO[str]] | None, kwargs: dict[str, Any], processes: EvalProcesses,
         done: set[tuple[int, int]]) -> tuple[list[dict[str, Any]], float, int]:
    """Generate ``num_samples`` completions per problem with the ``generate`` arguments ``kwargs`` (this process's
    share of them under a launch, none of the ``done`` (problem, sample) keys), score them and write the rows to
    the file ``stream()`` opens when the first batch is scored. Returns the rows (in problem, sample order), the
    seconds spent in ``generate`` and its forward passes."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    settings, _ = model._resolve_settings(dict(kwargs))
    stop_ids = set(settings.stop_token_ids) | set(tokenizer.all_special_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else settings.pad_token_id
    problems, prompts, token_ids = prepared.problems, prepared.prompts, prepared.token_ids
    work = sorted(((i, s) for i in range(len(problems)) for s in range(config.num_samples)),
                  key=lambda w: -len(token_ids[w[0]]))  # similar lengths together: less padding
    work = processes.shard([w for w in work if w not in done])
    limits = SandboxLimits(timeout=config.code_timeout, memory_mb=config.code_memory_mb,
                           max_output_bytes=config.code_max_output_bytes)
    math_reward = config.math_reward()
    rows: list[dict[str, Any]] = []
    seconds, forward_passes = 0.0, 0
    handle = None  # opened when the first batch is scored: a run that fails before (an invalid setting that
    # generate() refuses, prompts too long for the model) leaves an earlier run's files in output_dir as they were
    bar = tqdm(total=len(work), unit="sample", desc=f"eval {tag}", disable=not (config.progress and processes.is_main))
    try:
        for start in range(0, len(work), config.batch_size):
            batch = work[start: start + config.batch_size]
            ids, mask = left_pad([token_ids[i] for i, _ in batch], pad_id, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            began = time.perf_counter()
            # one generator per sample on the model's device, keyed by (seed, problem index, sample): a sample does
            # not depend on the batch size or on max_problems (and sampled decoding can use CUDA graphs)
            generator = [torch.Generator(device).manual_seed(stable_seed(config.seed, i, s)) for i, s in batch]
            out = model.generate(ids, attention_mask=mask, generator=generator, return_dict_in_generate=True,
                                 num_return_sequences=1, **kwargs)  # samples are rows of `work`, whatever the
            # checkpoint's generation_config.json says
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds += time.perf_counter() - began
            forward_passes += int(out.num_forward_passes or 0)
            width = ids.shape[1]
            decoded = [_completion(tokenizer, row[width:].tolist(), (steps[width:] >= 0).tolist(), stop_ids)
                       for row, steps in zip(out.sequences, out.unmask_step)]
            scores = score_completions([problems[i] for i, _ in batch], [d[0] for d in decoded], limits,
                                       config.code_workers, math_reward, config.code_grader)
            if stream is not None and handle is None:
                handle = stream()
            for j, ((i, s), (text, length, clipped), score) in enumerate(zip(batch, decoded, scores)):
                row = {"id": problems[i].id, "problem_digest": prepared.digests[i], "index": i, "sample": s,
                       "prompt": prompts[i], "completion": text,
                       "length": length, "clipped": clipped, "tokens_per_step": float(out.tokens_per_step[j]),
                       "denoising_steps": int(out.denoising_steps[j]), **score,
                       "correct": None if score["reward"] is None else score["reward"] == 1.0}
                rows.append(row)
                if handle:
                    handle.write(sample_line(row))
            if handle:
                handle.flush()  # a killed run keeps every scored batch (what --resume reads)
            bar.update(len(batch))
            bar.set_postfix(acc=f"{_mean([r['reward'] for r in rows if r['reward'] is not None]):.3f}")
    finally:
        bar.close()
        math_reward.close()
        if handle:
            handle.close()
    return sorted(rows, key=lambda r: (r["index"], r["sample"])), seconds, forward_passes


def _check_no_mask_token(mask_id: int, mask_token: str | None, problems: list[EvalProblem],
                         prompt_ids: list[list[int]], chat: bool) -> None:
    """Raise before any generation, naming the problems, when a prompt holds the mask id (its text holds the mask
    token's string): ``generate`` would refuse its batch with no problem named, after the earlier batches' work."""
    found = [repr(problem.id) for problem, ids in zip(problems, prompt_ids) if mask_id in ids]
    if found:
        fix = (f", or pass {SANITIZE_CONTROL_TOKENS}; on the command line --chat_template_kwargs "
               "'{\"sanitize_control_tokens\": true}'") if chat else ""
        raise ValueError(f"{len(found)} of {len(problems)} prompts hold {mask_token_name(mask_id, mask_token)}, which "
                         f"the model would read as a position to fill: {first_few(found)}. Remove or escape it in "
                         f"these problems{fix}.")


def _check_official_time_limits(problems: list[EvalProblem]) -> None:
    """Raise before any generation, naming the problems, when the official grader (which runs each test under the
    row's ``test_time_limit``) would refuse a row's limit (0, negative, non-finite): it raised at the first such
    completion, after the generation of every earlier batch."""
    bad = []
    for problem in problems:
        if problem.task == "code":
            try:
                time_limit_seconds(problem.time_limit)
            except ValueError:
                bad.append(f"{problem.id!r} ({problem.time_limit!r})")
    if bad:
        raise ValueError(f"--code_grader official runs each test under the row's test_time_limit, which must be a "
                         f"finite number of seconds > 0, but {len(bad)} problem(s) have another: {first_few(bad)}. "
                         "Fix these rows (or leave the field out for dLLM-RL's 1 s), or use --code_grader sandbox, "
                         "which uses --code_timeout.")


def _check_prompts_fit(model: Any, settings: Any, problems: list[EvalProblem], prompt_ids: list[list[int]]) -> None:
    """Raise before any generation, naming the problems, when a prompt and its new tokens do not fit the model's
    positions (``generate`` would refuse its batch with no problem named, after the earlier batches' work)."""
    limit = max_positions(model.config)
    if limit is None:
        return
    new = settings.max_new_tokens
    need = {length: CanvasLayout([length], new, settings.block_length, model.block_size is not None).row_positions()[0]
            for length in {len(ids) for ids in prompt_ids}}
    over = [(problem.id, len(ids), need[len(ids)]) for problem, ids in zip(problems, prompt_ids)
            if need[len(ids)] > limit]
    if over:
        shown = ", ".join(f"{pid!r} ({length} prompt + {new} new tokens, needs {positions})"
                          for pid, length, positions in over[:5])
        raise ValueError(f"{len(over)} of {len(problems)} problems do not fit the model's {limit} positions: "
                         f"{shown}{', ...' if len(over) > 5 else ''}. Lower max_new_tokens, or leave these problems "
                         "out of the dataset.")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _metrics(rows: list[dict], problems: list[EvalProblem], n: int, ks: list[int]) -> dict[str, Any]:
    """Accuracy over scored samples, unbiased pass@k over problems whose n samples were all scored."""
    scored = [r["reward"] for r in rows if r["reward"] is not None]
    unscored = len(rows) - len(scored)
    if unscored:
        logger.warning("%d of %d samples could not be scored (gold answer not parseable); they are left out.",
                       unscored, len(rows))
    # None, not 0.0, when nothing could be scored: an accuracy over no sample would read as "all wrong"
    metrics: dict[str, Any] = {"accuracy": _mean(scored) if scored else None, "num_scored": len(scored),
                               "num_unscored": unscored}
    per_problem: dict[int, list[dict]] = {}
    for r in rows:
        per_problem.setdefault(r["index"], []).append(r)
    complete = [rs for rs in per_problem.values() if all(r["reward"] is not None for r in rs)]
    for k in ks:
        metrics[f"pass@{k}"] = _mean([pass_at_k(n, sum(bool(r["correct"]) for r in rs), k) for rs in complete]
                                     ) if complete else None
    metrics["avg_length"] = _mean([r["length"] for r in rows])
    metrics["clipped_ratio"] = _mean([float(r["clipped"]) for r in rows])  # TRL's completions/clipped_ratio
    if problems[0].task == "math":
        metrics["boxed_rate"] = _mean([float(bool(r.get("prediction"))) for r in rows])
    else:  # a sandbox that could not run scores 0.0 (never a pass the program's code could provoke), counted here
        metrics["num_sandbox_errors"] = sum(r.get("status") == "sandbox_error" for r in rows)
        if metrics["num_sandbox_errors"]:
            logger.warning("%d of %d samples scored 0.0 because the sandbox could not run their program (status "
                           "'sandbox_error' in the samples file; see the logs above): accuracy and pass@k count "
                           "them as wrong.", metrics["num_sandbox_errors"], len(rows))
    return metrics


def _speed(rows: list[dict], new_rows: list[dict], seconds: float, forward_passes: int) -> dict[str, float | None]:
    """Mean tokens per denoising step over all ``rows`` (stored in each), and the completion tokens (up to the stop
    token) of the ``new_rows`` this run generated per second of ``generate`` (None when it generated none: a resume
    of a finished run)."""
    tokens = sum(r["length"] for r in new_rows)
    return {"tokens_per_step": _mean([r["tokens_per_step"] for r in rows]), "generation_seconds": seconds,
            "throughput_tokens_per_s": (tokens / seconds if seconds > 0 else 0.0) if new_rows else None,
            "num_forward_passes": forward_passes}
