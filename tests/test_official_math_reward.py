"""dLLM-RL's math reward (``official_math_reward``): the official answer rules on a table of cases, the length rule,
gold columns, and the sympy child process (hard timeout, restart, no leaked process or thread, any thread)."""

import os
import pickle
import random
import sys
import textwrap
import threading
import time

import pytest

from trl_diffusion.rewards import OfficialMathReward, make_official_math_reward, official_math_reward
from trl_diffusion.rewards.dllm_rl_math import SympyWorker, repeatness, suffix_ranks

# (completion, gold, expected). Every case is settled by the Hendrycks rules or by Minerva-normalised strings, so
# it holds with or without sympy's LaTeX parser (which needs antlr4 4.11).
CASES = [
    (r"So \boxed{\dfrac{1}{2}}.", r"\frac{1}{2}", 1.0),  # dfrac -> frac
    (r"\boxed{\tfrac{1}{2}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac12}", r"\frac{1}{2}", 1.0),  # shorthand fraction braced
    (r"\boxed{\frac1{72}}", r"\frac{1}{72}", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),  # 0.5 is \frac{1}{2}
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{.5}", "0.5", 1.0),  # leading zero added
    (r"\boxed{1/2}", r"\frac{1}{2}", 1.0),  # a/b of integers
    (r"\boxed{5.0}", "5", 1.0),  # equal as floats
    (r"\boxed{10\text{ cm}}", "10", 1.0),  # a trailing "\text{ unit}"
    (r"\boxed{5 \text{ inches}}", "5", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),  # degrees
    (r"\boxed{90^{\circ}}", "90", 1.0),
    (r"\boxed{50\%}", "50", 1.0),  # percent
    (r"\boxed{\$18.90}", "18.90", 1.0),  # dollars
    (r"\boxed{1,000}", "1000", 1.0),  # thousands separator
    (r"\boxed{x = 5}", "5", 1.0),  # a short left-hand side
    (r"\boxed{\sqrt2}", r"\sqrt{2}", 1.0),
    (r"\boxed{ \left( 3, \frac{\pi}{2} \right) }", r"\left( 3, \frac{\pi}{2} \right)", 1.0),  # spaces, \left
    (r"\boxed{\text{(C)}}", r"\text{(C)}", 1.0),
    (r"\boxed{\textbf{5}}", "5", 1.0),  # not Hendrycks-equal: settled by the sympy step's normalised strings
    (r"\boxed{3}, no wait: \boxed{5}", "5", 1.0),  # the last box wins
    (r"\boxed{3}, no wait: \boxed{5}", "3", 0.0),
    (r"\boxed{5} and then \boxed{5", "5", 0.0),  # the last box is unclosed: no answer, no fallback
    ("The answer is 5.", "5", 0.0),  # no box
    (r"\fbox{5}", "5", 0.0),  # only \boxed{ counts
    (r"\boxed {5}", "5", 0.0),
    (r"\boxed{6}", "5", 0.0),
    (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", 0.0),
    (r"\boxed{12\text{ cm}\text{ long}}", "12", 0.0),  # two units: the raw strings are compared
    (r"\boxed{x + 1}", r"x + 2", 0.0),
]


# the rules, with a time limit no loaded test machine reaches (the limit itself is tested below)
RULES = OfficialMathReward(timeout=60.0)


@pytest.mark.parametrize(("completion", "gold", "expected"), CASES)
def test_official_rules(completion, gold, expected):
    assert RULES([completion], answer=[gold]) == [expected]


def test_chat_completions_and_gold_columns():
    """(All settled by the Hendrycks rules, without the sympy child.)"""
    chat = [[{"role": "assistant", "content": r"so \boxed{\dfrac{3}{4}}"}]]
    # ground_truth_answer (dLLM-RL's column) wins over answer
    assert official_math_reward(chat, ground_truth_answer=[r"\frac{3}{4}"], answer=["1"]) == [1.0]
    assert official_math_reward(chat, ground_truth_answer=["1"], answer=[r"\frac{3}{4}"]) == [0.0]
    # a full solution: its last box
    assert official_math_reward(chat, solution=[r"... so $\boxed{\frac34}$."]) == [1.0]
    assert official_math_reward(chat, answer=[None]) == [None]  # no gold: TRL leaves the row out


def test_length_rule():
    reward = make_official_math_reward(max_tokens=20)
    texts = [r"\boxed{5}"] * 4
    ids = [[1] * 14, [1] * 15, [1] * 19, [1] * 20]  # 15 = max_tokens - 5 reaches the limit
    assert reward(texts, completion_ids=ids, answer=["5"] * 4) == [1.0, 0.0, 0.0, 0.0]
    assert official_math_reward(texts, completion_ids=ids, answer=["5"] * 4) == [1.0] * 4  # no length rule
    with pytest.raises(ValueError, match="completion_ids"):
        reward(texts, answer=["5"] * 4)
    with pytest.raises(ValueError, match="max_tokens"):
        make_official_math_reward(max_tokens=5)


def test_long_repetitive_answers_skip_sympy():
    """Over 128 characters and repetitive: not equal without the sympy step (which would say equal here)."""
    body = "ab" * 80
    assert repeatness(body)
    reward = OfficialMathReward(timeout=60.0)
    assert reward.equal("\\textbf{" + body[:60] + "}", body[:60])  # short: the sympy step's normalisation matches
    assert not reward.equal("\\textbf{" + body + "}", body)
    reward.close()


def test_suffix_ranks_equal_sorting_the_suffixes():
    """The repetition test's suffix ranks (numpy prefix doubling: 0.5 s -> 0.14 s on 32,000 characters) equal the
    obvious ones: each suffix's first ``span`` characters ranked among all of them, ties sharing a rank; lengths
    around powers of two + 1, where the doubling stops with the whole string still tied to its shift."""
    rng = random.Random(0)
    for trial in range(400):
        n = (1, 2, 3, 5, 9, 17, 33)[trial % 7] if trial < 70 else rng.randint(1, 80)
        alphabet = ("a", "ab", "abc", "0123456789 +-")[trial % 4]
        text = "".join(rng.choice(alphabet) for _ in range(n))
        span = 1
        while span < n - 1:
            span *= 2
        prefixes = [text[i:i + span] for i in range(n)]
        order = {prefix: rank for rank, prefix in enumerate(sorted(set(prefixes)))}
        assert suffix_ranks([ord(c) for c in text]) == [order[prefix] for prefix in prefixes], text


SLOW_SERVER = textwrap.dedent("""
    import sys, time
    sys.stdout.write("ready\\n"); sys.stdout.flush()
    for line in sys.stdin:
        if "slow" in line:
            time.sleep(600)
        sys.stdout.write("1\\n"); sys.stdout.flush()
""")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_timeout_kills_the_child_and_the_next_call_restarts_it():
    threads = threading.active_count()
    worker = SympyWorker(timeout=0.5, command=[sys.executable, "-c", SLOW_SERVER])
    assert worker.compare("fast", "x") is True
    first = worker.pid
    start = time.monotonic()
    assert worker.compare("slow", "x") is False  # ran out of time: not equal
    assert time.monotonic() - start < 60  # generous bound: it was killed, not waited for
    assert worker.timeouts == 1 and worker.pid is None and not _alive(first)  # killed and reaped
    assert worker.compare("fast", "x") is True  # a fresh child
    second = worker.pid
    assert second != first
    worker.close()
    assert not _alive(second)
    assert threading.active_count() == threads  # no thread was started


EQUAL_SERVER = textwrap.dedent("""
    import json, sys
    sys.stdout.write("ready\\n"); sys.stdout.flush()
    for line in sys.stdin:
        a, b = json.loads(line)
        sys.stdout.write("1\\n" if a == b else "0\\n"); sys.stdout.flush()
""")


def test_an_interrupted_comparison_does_not_answer_the_next_one(monkeypatch):
    # A KeyboardInterrupt while waiting for the child left its answer in the pipe: every later comparison then
    # read the previous one's answer ("6 dollars" vs "5" scored 1.0).
    worker = SympyWorker(timeout=30.0, command=[sys.executable, "-c", EQUAL_SERVER])
    assert worker.compare("a", "a") is True
    first = worker.pid

    def interrupted(timeout):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(worker, "_read_line", interrupted)
        with pytest.raises(KeyboardInterrupt):
            worker.compare("x", "x")  # its "1" is on its way
    assert worker.pid is None and not _alive(first)  # the child with the unread answer was stopped
    assert worker.compare("a", "b") is False
    assert worker.compare("c", "c") is True
    worker.close()


def test_worker_runs_in_any_thread_and_pickles():
    reward = make_official_math_reward(max_tokens=100, timeout=60.0)
    results = []
    thread = threading.Thread(target=lambda: results.append(
        reward([r"\boxed{\textbf{7}}"], completion_ids=[[1, 2]], answer=["7"])))
    thread.start()
    thread.join(timeout=300)
    assert results == [[1.0]]  # the sympy step (a child process), from a non-main thread
    pid = reward.worker.pid
    copy = pickle.loads(pickle.dumps(reward))
    assert copy.worker.pid is None and copy.max_tokens == 100
    assert copy([r"\boxed{\textbf{7}}"], completion_ids=[[1]], answer=["7"]) == [1.0]
    reward.close()
    copy.close()
    assert not _alive(pid)


@pytest.mark.slow
def test_a_real_runaway_comparison_is_cut_off():
    """A 60k-character answer with one "$": the Minerva regex alone needs minutes; the child is killed at 1 s."""
    import random

    rng = random.Random(0)
    answer = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(60000))
    answer = answer[:10] + "$" + answer[10:]
    reward = OfficialMathReward()
    assert reward.worker.timeout == 1.0  # dLLM-RL's limit (math_utils.py 189)
    start = time.monotonic()
    assert reward([f"\\boxed{{{answer}}}"], answer=["5"]) == [0.0]
    assert time.monotonic() - start < 120
    assert reward.worker.timeouts == 1 and reward.worker.pid is None
    reward.worker.timeout = 60.0  # the next comparison starts a fresh child
    assert reward([r"\boxed{\textbf{5}}"], answer=["5"]) == [1.0]
    reward.close()
