"""Benchmark loaders: Hub names, local json / jsonl / parquet files and the synthetic arithmetic task, all turned into
one :class:`EvalProblem` list. The format of a file or Hub dataset is detected from its columns (:data:`FORMATS`)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data.loading import LOCAL_SUFFIXES, rows_wrapper_key
from ..rewards import build_tests, extract_gold_answer
from ..rewards.dllm_rl_code import stdio_tests

__all__ = [
    "FORMATS",
    "HUB_DATASETS",
    "LOCAL_EXTENSIONS",
    "CODE_HEADER_PROMPT",
    "CODE_PROMPT_PRESETS",
    "MATH_PROMPT",
    "PRESET_MODEL_TYPES",
    "PROMPT_PRESETS",
    "EvalProblem",
    "detect_format",
    "load_eval_problems",
    "problems_from_rows",
]

MATH_PROMPT = "{question}\nPlease reason step by step, and put your final answer within \\boxed{}."
"""TraDo's math prompt (dLLM-RL sample scripts), as the user turn of the chat template."""
CODE_PROMPT = "{question}\n\nWrite a Python solution and put the complete code in one ```python``` code block."
STDIO_PROMPT = (
    "{question}\n\nWrite a Python program that reads the input from standard input and prints the answer to standard "
    "output. Put the complete program in one ```python``` code block."
)
FUNCTION_PROMPT = (
    "Complete the following Python function.\n```python\n{question}```\n"
    "Return the complete function, with any imports it needs, in one ```python``` code block."
)
CODE_HEADER_PROMPT = (
    "{question}\n\nComplete the following Python code:\n```python\n{header}```\n"
    "Put the complete code, starting with these lines, in one ```python``` code block."
)
r"""The default prompt of a ``code_tests`` function row whose ``prefix`` opens a code block (dLLM-RL's
``"```python\ndef add(a, b):\n"``): the question, then the prefix's code (``{header}``) to complete."""
_DLLM_RL_BOXED = "You need to put your final answer in \\boxed{}. This is the problem:\n{question}"
_SDAR_TURN = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant"
_DREAM_SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
_LLADA_TURN = ("<|startoftext|><|start_header_id|>user<|end_header_id|>{}<|eot_id|><|startoftext|>"
               "<|start_header_id|>assistant<|end_header_id|>")
_DLLM_RL_FUNCTION = ("{question}\nPlace your code within a single Python code block ```python ```. Do not include "
                     "more than one code block. ")
_DLLM_RL_STDIO = ("This is the problem:\n{question}\n{space}You should put your code in ```python ```. Use input() to "
                  "read input and print() to produce output in your script. ")
PROMPT_PRESETS: dict[str, str] = {
    "dllm_rl_sdar": _SDAR_TURN.format(MATH_PROMPT),
    "dllm_rl_sdar_think": _SDAR_TURN.format(_DLLM_RL_BOXED) + "<think>",
    "dllm_rl_llada": _LLADA_TURN.format(_DLLM_RL_BOXED),
    "dllm_rl_dream": _DREAM_SYSTEM + _SDAR_TURN.format(_DLLM_RL_BOXED),
}  # fmt: skip
"""``prompt_template`` names for dLLM-RL's prompts, whole prompts used without the chat template, exactly as its
``sample/{trado,sdar,llada,dream}_sample.py`` and ``*_rl_rollout.py`` render them: SDAR / TraDo (``_think``:
``start_with_think``), LLaDA, Dream. jinja2 drops the templates' final newline, so they end at ``assistant``
(``<think>``, ``<|end_header_id|>``). These are the math prompts; code rows get :data:`CODE_PROMPT_PRESETS`."""
PRESET_MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "dllm_rl_sdar": ("sdar", "sdar_moe"), "dllm_rl_sdar_think": ("sdar", "sdar_moe"), "dllm_rl_llada": ("llada",),
    "dllm_rl_dream": ("Dream",),
}
"""The ``model_type`` values each :data:`PROMPT_PRESETS` prompt was written for (its chat markup is that family's)."""
CODE_PROMPT_PRESETS: dict[str, tuple[str, str]] = {
    "dllm_rl_sdar": (_SDAR_TURN.format(_DLLM_RL_FUNCTION) + "\n",
                     _SDAR_TURN.format(_DLLM_RL_STDIO.replace("{space}", ""))),
    "dllm_rl_sdar_think": (_SDAR_TURN.format(_DLLM_RL_FUNCTION) + "\n",
                           _SDAR_TURN.format(_DLLM_RL_STDIO.replace("{space}", "")) + "<think>"),
    "dllm_rl_llada": (_LLADA_TURN.format(_DLLM_RL_FUNCTION) + "\n",
                      _LLADA_TURN.format(_DLLM_RL_STDIO.replace("{space}", " "))),
    "dllm_rl_dream": (_DREAM_SYSTEM + _SDAR_TURN.format(_DLLM_RL_FUNCTION) + "\n",
                      _DREAM_SYSTEM + _SDAR_TURN.format(_DLLM_RL_STDIO.replace("{space}", ""))),
}  # fmt: skip
"""The same names' code prompts (``test_method`` ``function``, ``stdio``), as dLLM-RL renders them for its code files
(``code_tests`` format): a ``function`` prompt ends with the line break after ``assistant``, then comes the row's
``prefix`` (the start of the answer, which the completion continues), and jinja2 drops the final newline of that
whole text. Only ``stdio`` has a ``<think>``
variant (``start_with_think``); LLaDA's stdio prompt has a space before "You should"."""
ARITHMETIC_PROMPT = "{question}"
"""The arithmetic task's user turn; without the chat template the prompt is ``"{question}\n"``, the embedded
model's training format (``to_dataset(..., "prompt_completion")``)."""

HUB_DATASETS: dict[str, tuple[str, str | None, str]] = {
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "aime2024": ("HuggingFaceH4/aime_2024", None, "train"),
    "humaneval": ("openai/openai_humaneval", None, "test"),
    "mbpp": ("google-research-datasets/mbpp", "full", "test"),
}
"""Short name -> (Hub repo, config, split)."""
LOCAL_EXTENSIONS = LOCAL_SUFFIXES  # the file names the training examples read as local files too

FORMATS: dict[str, str] = {
    "humaneval": "prompt + test + entry_point (HumanEval): complete the function, run check(entry_point)",
    "code_tests": "question + test_method (+ test_list | test_input/test_output, prefix) (dLLM-RL / LiveCodeBench)",
    "mbpp": "text or prompt + test_list (MBPP): assert statements",
    "problem_answer": "problem + answer (MATH-500, AIME): math, gold = answer",
    "question_answer": "question + answer, optionally '... #### 18' (GSM8K): math",
    "question_ground_truth": "question + ground_truth_answer (dLLM-RL math): math",
}
"""Formats recognised from the columns, checked in this order."""


@dataclass
class EvalProblem:
    """One benchmark problem, ready to prompt and score.

    ``task`` is ``"math"`` (``answer`` holds the gold answer as the math reward reads it) or ``"code"`` (``tests``:
    snippets run in the program's namespace; ``prefix`` goes before the model's code; ``header``: code the answer
    starts with, shown in the prompt, which goes before the model's code when the two together are valid Python
    (a completion that continues it) and is left out otherwise (a completion that restates it); ``stdio``: each test
    feeds stdin to the program and compares stdout; ``time_limit``: dLLM-RL's ``test_time_limit``, read by its
    grader). ``prompt`` is the user turn, instruction included (a :data:`PROMPT_PRESETS` prompt: the whole prompt).
    ``response_prefix`` ends the prompt and starts the answer: scoring reads it followed by the completion.
    """

    id: str
    prompt: str
    task: str
    answer: str | None = None
    tests: list[str] = field(default_factory=list)
    prefix: str = ""
    stdio: bool = False
    response_prefix: str = ""
    time_limit: float | None = None
    header: str = ""


def detect_format(columns: Iterable[str]) -> str:
    """Name of the first format in :data:`FORMATS` whose columns are all present (names compared in lower case)."""
    cols = {c.lower() for c in columns}
    if {"prompt", "test", "entry_point"} <= cols:
        return "humaneval"
    if {"question", "test_method"} <= cols:
        return "code_tests"
    if "test_list" in cols and cols & {"text", "prompt"}:
        return "mbpp"
    if {"problem", "answer"} <= cols:
        return "problem_answer"
    if {"question", "answer"} <= cols:
        return "question_answer"
    if {"question", "ground_truth_answer"} <= cols:
        return "question_ground_truth"
    known = "; ".join(f"{name}: {text}" for name, text in FORMATS.items())
    raise ValueError(f"unknown dataset format: columns {sorted(cols)} match none of the known formats ({known}).")


def problems_from_rows(rows: list[Mapping[str, Any]], prompt_template: str | None = None) -> list[EvalProblem]:
    """Detect the format of ``rows`` and convert every row; raises if a row has no gold answer or no tests."""
    if not rows:
        raise ValueError("the dataset has no rows.")
    if not all(isinstance(row, Mapping) for row in rows):
        raise ValueError(f"each row must be a mapping of column names to values, got a {type(rows[0]).__name__}"
                         f"{'' if isinstance(rows[0], Mapping) else f' ({rows[0]!r:.60})'}.")
    rows = [{str(k).lower(): v for k, v in row.items()} for row in rows]
    fmt = detect_format(rows[0])
    problems = []
    for index, row in enumerate(rows):
        try:
            problems.append(_convert(fmt, row, index, prompt_template))
        except KeyError as exc:  # the format was detected from the first row; a later row may lack a column
            raise ValueError(f"row {index} has no {exc.args[0]!r} column, which format {fmt!r} (detected from the "
                             f"first row's columns) needs; its columns are {sorted(row)}.") from None
        except BadValue as exc:  # None or a number where the text goes (a missing value in a table), a bad limit
            raise ValueError(f"row {index} (format {fmt!r}): {exc}") from None
    bad = [p.id for p in problems if (p.answer is None if p.task == "math" else not p.tests)]
    if bad:
        what = "gold answer" if problems[0].task == "math" else "tests"
        raise ValueError(f"{len(bad)} row(s) of format {fmt!r} have no usable {what}, e.g. ids {bad[:5]}.")
    return problems


def load_eval_problems(
    dataset: str,
    config: str | None = None,
    split: str | None = None,
    max_problems: int | None = None,
    prompt_template: str | None = None,
    chat_template: bool = True,
) -> tuple[str, list[EvalProblem]]:
    """Load ``dataset`` (a short name, ``arithmetic``, a local file, or a Hub ``owner/name``); return (tag, problems).

    ``tag`` is a short file-name-safe name of the dataset, used for output files. ``chat_template`` says whether
    the prompts will go through the chat template (the arithmetic task's plain prompts end with a newline).
    """
    if max_problems is not None and max_problems <= 0:
        raise ValueError(f"max_problems must be positive, got {max_problems}.")
    name = dataset.strip()
    hub_only = [f"{flag}={value!r}" for flag, value in (("dataset_config", config), ("dataset_test_split", split))
                if value is not None]
    if hub_only and (name.lower() == "arithmetic" or _is_local(name)):
        raise ValueError(f"{' and '.join(hub_only)}: these flags apply to Hub datasets only, but {name!r} is "
                         f"{'the built-in task' if name.lower() == 'arithmetic' else 'a local file'}, evaluated "
                         "whole; leave them unset (or put the split you want in a file of its own).")
    if name.lower() == "arithmetic":
        problems = _arithmetic_problems(prompt_template, chat_template)
        tag = "arithmetic"
    else:
        rows, tag = _load_rows(name, config, split)
        problems = problems_from_rows(rows[:max_problems], prompt_template)
    return tag, problems[:max_problems]


def _is_local(name: str) -> bool:
    path = Path(os.path.expanduser(name))
    return path.suffix.lower() in LOCAL_EXTENSIONS or path.is_file()


def _load_rows(name: str, config: str | None, split: str | None) -> tuple[list[dict], str]:
    if _is_local(name):
        path = Path(os.path.expanduser(name))
        return _read_local(path), path.stem
    if name.lower() in HUB_DATASETS:
        repo, default_config, default_split = HUB_DATASETS[name.lower()]
        return _read_hub(repo, config or default_config, split or default_split), name.lower()
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return _read_hub(name, config, split or "test"), name.replace("/", "__")
    folder = f" ({name!r} is a folder here: give a file in it)" if Path(os.path.expanduser(name)).is_dir() else ""
    raise ValueError(
        f"unknown dataset {name!r}: use one of {sorted(HUB_DATASETS) + ['arithmetic']}, a local "
        f"{'/'.join(LOCAL_EXTENSIONS)} file, or a Hub dataset id 'owner/name'{folder}."
    )


def _read_local(path: Path) -> list[dict]:
    if not path.exists():
        raise FileNotFoundError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix not in LOCAL_EXTENSIONS:
        raise ValueError(f"unsupported dataset file {path}: expected one of {LOCAL_EXTENSIONS}.")
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark is not text (as training reads files)
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = _json_lines(path, text)
    if isinstance(data, dict):  # {"rows": [...]} (with metadata or not), or a single problem (one JSON line)
        key = rows_wrapper_key(data)  # the rule training reads files with (data/loading.py)
        data = data[key] if key is not None else [data]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path} must hold a list of JSON objects (one per problem).")
    return data


def _json_lines(path: Path, text: str) -> list[dict]:
    """The objects of a JSON lines file, one per non-blank line; an error names the file's line."""
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is neither JSON nor JSON lines: line {number}: {exc.msg} (column {exc.colno})"
                             ) from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} must hold JSON objects (one per problem); line {number} is a "
                             f"{type(row).__name__}.")
        rows.append(row)
    return rows


def _read_hub(repo: str, config: str | None, split: str) -> list[dict]:
    from datasets import load_dataset

    try:  # "hf://datasets/": from the Hub only (`load_dataset(repo)` reads a local folder of that path instead)
        data = load_dataset(f"hf://datasets/{repo}", config, split=split)
    except Exception as exc:
        local = " (a local folder of that name is not read: give a file in it)" if os.path.isdir(repo) else ""
        raise ValueError(f"could not load Hub dataset {repo!r} (config={config!r}, split={split!r}): {exc}"
                         f"{local}") from exc
    return data.to_list()


def _convert(fmt: str, row: dict, index: int, template: str | None) -> EvalProblem:
    pid = str(row.get("task_id", row.get("id", row.get("unique_id", index))))
    if template in PROMPT_PRESETS and fmt in ("humaneval", "mbpp"):
        raise ValueError(f"prompt_template={template!r} is dLLM-RL's prompt, which it renders from its own code files "
                         f"(question, test_method, test_list, prefix: the `code_tests` format), not from {fmt!r} "
                         "rows: evaluate its copy (e.g. Gen-Verse/HumanEval, Gen-Verse/MBPP as a local file) or "
                         "pass a prompt_template with {question}.")
    if fmt == "humaneval":
        tests = build_tests(test=row["test"], entry_point=row["entry_point"]) or []
        return EvalProblem(pid, _fill(template or FUNCTION_PROMPT, row["prompt"]), "code", tests=tests,
                           prefix=row["prompt"])
    if fmt == "mbpp":
        text = row.get("text") or row.get("prompt") or ""
        tests = build_tests(tests=row["test_list"]) or []
        question = f"{text}\nYour code should pass these tests:\n" + "\n".join(tests)
        imports = row.get("test_imports") or []
        prefix = "\n".join([*imports, row.get("test_setup_code") or ""]).strip()
        return EvalProblem(pid, _fill(template or CODE_PROMPT, question), "code", tests=tests, prefix=prefix)
    if fmt == "code_tests":
        return _code_tests_problem(pid, row, template)
    question = row["problem"] if fmt == "problem_answer" else row["question"]
    gold = row["ground_truth_answer"] if fmt == "question_ground_truth" else row["answer"]
    answer = extract_gold_answer(answer=gold)
    return EvalProblem(pid, _fill(template or MATH_PROMPT, question), "math", answer=answer)


def _code_tests_problem(pid: str, row: dict, template: str | None) -> EvalProblem:
    """dLLM-RL's code schema: ``test_method`` ``function`` (``test_list`` asserts, ``prefix``) or ``stdio``. With a
    :data:`PROMPT_PRESETS` name the prompt is dLLM-RL's, and a function row's ``prefix`` ends it. Without one, a
    ``prefix`` that opens a code block (dLLM-RL's files) becomes the ``header`` without its fence, shown to the model
    by the default prompt (:data:`CODE_HEADER_PROMPT`); any other ``prefix`` goes before the code as written."""
    method = str(row["test_method"]).lower()
    limit = _time_limit(pid, row.get("test_time_limit"))
    preset = CODE_PROMPT_PRESETS.get(template) if template in PROMPT_PRESETS else None
    if method == "function":
        tests = build_tests(tests=row.get("test_list")) or []
        prefix = row.get("prefix") or ""
        if preset is not None:  # jinja2 renders template + prefix and drops the final newline
            prompt = _fill(preset[0], row["question"]) + prefix
            prompt = prompt[:-1] if prompt.endswith("\n") else prompt
            return EvalProblem(pid, prompt, "code", tests=tests, response_prefix=prefix, time_limit=limit)
        header = _fenced_code(prefix)
        if header is None:  # plain code (imports, setup): always put before the model's code
            return EvalProblem(pid, _fill(template or CODE_PROMPT, row["question"]), "code", tests=tests,
                               prefix=prefix, time_limit=limit)
        if template or not header:
            prompt = _fill(template or CODE_PROMPT, row["question"])
        else:  # split at {header} first, so that neither text is searched for the other's placeholder
            before, after = CODE_HEADER_PROMPT.split("{header}")
            prompt = _fill(before, row["question"]) + header + after
        return EvalProblem(pid, prompt, "code", tests=tests, header=header, time_limit=limit)
    if method == "stdio":
        tests = stdio_tests(row.get("test_input"), row.get("test_output"), row=f"problem {pid}")
        prompt = _fill(preset[1] if preset is not None else template or STDIO_PROMPT, row["question"])
        return EvalProblem(pid, prompt, "code", tests=tests, stdio=True, time_limit=limit)
    raise ValueError(f"problem {pid}: unknown test_method {row['test_method']!r} (expected 'function' or 'stdio').")


def _time_limit(pid: str, value: Any) -> float | None:
    """A row's ``test_time_limit`` in seconds, ``None`` when it has none (dLLM-RL's default, 1 s). A value that is no
    number (``""`` from an empty cell, other text) is refused when the problems load, naming the field and the
    problem, rather than failing with a bare ``float()`` error. A number only ``--code_grader official`` reads
    (0, negative, non-finite) is checked by ``evaluate`` for that grader, before generation; the sandbox grader
    uses ``code_timeout`` and never reads it."""
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise BadValue(f"'test_time_limit' of problem {pid} must be a number of seconds, got {value!r}: fix it, or "
                       "leave the field out (or null) for dLLM-RL's default of 1 s.") from None


def _fenced_code(prefix: str) -> str | None:
    r"""The code of a ``prefix`` that opens a Markdown code block (``"```python\ndef add(a, b):\n"`` gives
    ``"def add(a, b):\n"``): the lines after the fence's info line, up to a closing fence if there is one, ending with
    a line break (``""`` if no code follows the fence). ``None`` for a prefix that does not start with a fence."""
    text = prefix.lstrip()
    if not text.startswith("```"):
        return None
    code = re.split(r"^[ \t]*```", text.partition("\n")[2], maxsplit=1, flags=re.MULTILINE)[0]
    if not code.strip():
        return ""
    return code if code.endswith("\n") else code + "\n"


def _fill(template: str, question: str) -> str:
    """Put the question where ``{question}`` is; every other character of the template is kept as written. A name in
    :data:`PROMPT_PRESETS` stands for its prompt."""
    template = PROMPT_PRESETS.get(template, template)
    if "{question}" not in template:
        raise ValueError(f"prompt_template must contain '{{question}}', got {template!r}.")
    if not isinstance(question, str):
        raise NotText(f"the question must be text, got {question!r}.")
    return template.replace("{question}", question)


class BadValue(ValueError):
    """A row's field holds a value its problem cannot use: ``problems_from_rows`` names the row and its format."""


class NotText(BadValue):
    """A row's question (or prompt) is not a string: ``problems_from_rows`` names the row."""


def _arithmetic_problems(template: str | None, chat_template: bool) -> list[EvalProblem]:
    """The held-out split of the task the embedded model was trained on (``trl_diffusion.assets.EMBEDDED_TASK``)."""
    from ..assets import EMBEDDED_TASK
    from ..data import make_problems

    _, test = make_problems(**EMBEDDED_TASK)
    template = template or (ARITHMETIC_PROMPT if chat_template else ARITHMETIC_PROMPT + "\n")
    return [EvalProblem(f"arithmetic/{i}", _fill(template, p.prompt), "math", answer=str(p.answer))
            for i, p in enumerate(test)]
