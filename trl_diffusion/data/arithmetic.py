"""A synthetic arithmetic task small enough to learn from scratch on a CPU: "What is 47+35?" -> "\\boxed{82}".

Problems are seeded, train and held-out sets are disjoint, datasets come in TRL's formats, and
``evaluate_accuracy`` measures greedy exact match with ``model.generate`` (used by tests, examples and
benchmarks).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch
from datasets import Dataset

from ..states import left_pad

DATASET_FORMATS = ("conversational", "prompt_completion", "text")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


@dataclass(frozen=True)
class ArithmeticProblem:
    """``a op b`` with ``op`` in ``+`` / ``-``."""

    a: int
    b: int
    op: str

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    @property
    def prompt(self) -> str:
        return f"What is {self.a}{self.op}{self.b}?"

    @property
    def completion(self) -> str:
        return f"\\boxed{{{self.answer}}}"


def _sample(rng: random.Random, digits: int, ops: tuple[str, ...], allow_negative: bool) -> ArithmeticProblem:
    high = 10**digits - 1
    a, b, op = rng.randint(0, high), rng.randint(0, high), rng.choice(ops)
    if op == "-" and not allow_negative and b > a:
        a, b = b, a
    return ArithmeticProblem(a, b, op)


def make_problems(
    num_train: int,
    num_test: int,
    digits: int = 2,
    ops: tuple[str, ...] = ("+", "-"),
    seed: int = 0,
    allow_negative: bool = False,
) -> tuple[list[ArithmeticProblem], list[ArithmeticProblem]]:
    """Disjoint, duplicate-free train and held-out problems with operands of up to ``digits`` digits.

    Seeded: the same arguments give the same problems. Subtraction keeps results non-negative unless
    ``allow_negative``. Raises if the problem space is too small for the requested counts.
    """
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}.")
    for name, count in (("num_train", num_train), ("num_test", num_test)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {count!r}.")
    if not ops or any(op not in ("+", "-") for op in ops):
        raise ValueError(f"ops must be a non-empty subset of ('+', '-'), got {ops}.")
    n = 10**digits
    space = n * n * ("+" in ops) + (n * n if allow_negative else n * (n + 1) // 2) * ("-" in ops)
    if num_train + num_test > space:
        raise ValueError(f"only {space} distinct problems exist with {digits} digit(s) and ops {ops}; "
                         f"asked for {num_train + num_test}.")
    rng = random.Random(seed)
    seen: set[ArithmeticProblem] = set()
    problems: list[ArithmeticProblem] = []
    while len(problems) < num_train + num_test:
        problem = _sample(rng, digits, tuple(ops), allow_negative)
        if problem not in seen:
            seen.add(problem)
            problems.append(problem)
    return problems[num_test:], problems[:num_test]


def to_dataset(problems: list[ArithmeticProblem], dataset_format: str = "conversational") -> Dataset:
    """A ``datasets.Dataset`` in one of TRL's formats, plus ``answer`` (str) and ``solution`` (the boxed answer,
    what ``trl.rewards.accuracy_reward`` reads):

    * ``conversational``: ``prompt`` = [user message], ``completion`` = [assistant message];
    * ``prompt_completion``: plain-text ``prompt`` (ending in a newline) and ``completion``;
    * ``text``: one ``text`` column (language modelling).
    """
    if dataset_format not in DATASET_FORMATS:
        raise ValueError(f"dataset_format must be one of {DATASET_FORMATS}, got {dataset_format!r}.")
    rows = []
    for p in problems:
        extra = {"answer": str(p.answer), "solution": p.completion}
        if dataset_format == "conversational":
            rows.append({"prompt": [{"role": "user", "content": p.prompt}],
                         "completion": [{"role": "assistant", "content": p.completion}], **extra})
        elif dataset_format == "prompt_completion":
            rows.append({"prompt": p.prompt + "\n", "completion": p.completion, **extra})
        else:
            rows.append({"text": f"{p.prompt}\n{p.completion}", **extra})
    return Dataset.from_list(rows)


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (stripped), or None."""
    found = _BOXED.findall(text)
    return found[-1].strip() if found else None


def score_completion(completion: str | list[dict], answer: int | str) -> bool:
    """Exact match: the last ``\\boxed{...}`` of the completion equals the answer (as a string). Accepts a plain
    string or a conversational completion (the last message's content)."""
    if isinstance(completion, list):
        completion = completion[-1]["content"] if completion else ""
    return extract_boxed(completion) == str(answer).strip()


def arithmetic_reward(completions, answer, **kwargs) -> list[float]:
    """TRL reward function: 1.0 when the completion's last ``\\boxed{}`` is exactly the row's ``answer``."""
    return [float(score_completion(c, a)) for c, a in zip(completions, answer)]


def _completion_text(tokenizer, ids: torch.Tensor) -> str:
    """Decode up to the first special token (EOS, end of turn, padding, mask)."""
    special = set(tokenizer.all_special_ids)
    tokens = ids.tolist()
    end = next((i for i, t in enumerate(tokens) if t in special), len(tokens))
    return tokenizer.decode(tokens[:end])


def _chat_prompt(tokenizer, prompt: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def _pad_id(model, tokenizer, settings: dict) -> int:
    """The tokenizer's pad token, else the one ``generate`` pads with, as ``trl-diffusion eval`` does (padded
    columns are masked out: any id serves)."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    # only what decides it: generate() also takes arguments its settings do not (synced_gpus, peft's adapter_names)
    kwargs = {key: settings[key] for key in ("pad_token_id", "eos_token_id", "stop_token_ids") if key in settings}
    return model._resolve_settings(kwargs)[0].pad_token_id


@torch.no_grad()
def generate_completions(model, tokenizer, prompts: list[str], batch_size: int = 64, chat_template: bool = True,
                         **generate_kwargs) -> list[str]:
    """Greedy completions of ``prompts`` with ``model.generate`` (left-padded batches). With ``chat_template`` the
    prompts are chat-formatted (conversational datasets); without, they are ``prompt + "\\n"`` as in the
    ``prompt_completion`` format, with the tokenizer's special tokens (e.g. BOS), as TRL's trainers and
    ``trl-diffusion eval`` tokenize plain prompts. A tokenizer without a pad token pads with the model's.

    Every setting that changes the tokens is given (``generate_kwargs`` override them), so the model's
    ``generation_config`` does not: no top-k / top-p (SDAR's and TraDo's released files hold Qwen3's top_k 20 and
    top_p 0.95, which would filter the greedy confidences), no ``alg_temp``, no guidance, one sequence per prompt,
    and no approximate cache (``use_cache=True``: SDAR's exact cache, none on LLaDA / Dream; a saved TraceRL policy
    may hold "prefix"). One completion per prompt, in order: ``num_return_sequences`` other than 1 and a
    ``batch_size`` below 1 are ValueErrors (the texts would no longer line up with the prompts)."""
    if generate_kwargs.get("num_return_sequences", 1) != 1:
        raise ValueError(f"num_return_sequences={generate_kwargs['num_return_sequences']!r}: one completion per "
                         "prompt is returned (and scored), in the prompts' order; repeat the prompts to sample "
                         "several.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
    settings = {"max_new_tokens": 16, "block_length": model.block_size or 16, "temperature": 0.0, "top_k": 0,
                "top_p": 1.0, "alg_temp": 0.0, "cfg_scale": 0.0, "use_cache": True, "num_return_sequences": 1,
                **generate_kwargs}
    if generate_kwargs.get("alg") is None:  # Dream's `alg` names the commit rule itself
        settings.setdefault("remasking_strategy", "low_confidence_static")
    if generate_kwargs.get("steps") is None:  # Dream's `steps` (whole generation) replaces the per-block steps
        settings.setdefault("denoising_steps", settings["block_length"])  # one token per step
    device = next(model.parameters()).device
    pad_id = _pad_id(model, tokenizer, settings)
    texts = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        formatted = [_chat_prompt(tokenizer, p) for p in chunk] if chat_template else [p + "\n" for p in chunk]
        # the chat template writes its own special tokens
        rows = tokenizer(formatted, add_special_tokens=not chat_template)["input_ids"]
        ids, attention_mask = left_pad(rows, pad_id, device)
        out = model.generate(ids, attention_mask=attention_mask, **settings)
        texts.extend(_completion_text(tokenizer, row[ids.shape[1]:]) for row in out)
    return texts


def evaluate_accuracy(model, tokenizer, problems: list[ArithmeticProblem], batch_size: int = 64,
                      **generate_kwargs) -> float:
    """Fraction of ``problems`` whose greedy completion (chat template, left padding, ``model.generate`` at
    temperature 0) boxes exactly the right answer. ``generate_kwargs`` override the defaults (16 new tokens, block
    length = model block size or 16, ``low_confidence_static`` with one token per denoising step, no top-k / top-p;
    see ``generate_completions``); Dream's ``alg`` / ``steps`` replace the strategy / the per-block steps."""
    if not problems:
        raise ValueError("no problems to evaluate.")
    # generate() decodes in eval mode and gives every module its own mode back
    texts = generate_completions(model, tokenizer, [p.prompt for p in problems], batch_size, **generate_kwargs)
    return sum(score_completion(t, p.answer) for t, p in zip(texts, problems)) / len(problems)
