"""The synthetic arithmetic task: seeded disjoint splits, TRL dataset formats, the exact-match scorer and
``evaluate_accuracy`` (chat template, left padding, greedy generate, batching)."""

import pytest
import torch
from numerics import MIN_MARGIN, DecisionMargins
from trl.data_utils import is_conversational

from trl_diffusion.data import evaluate_accuracy, extract_boxed, make_problems, score_completion, to_dataset
from trl_diffusion.data.arithmetic import ArithmeticProblem
from trl_diffusion.testing import EOS_ID, IM_END_ID, build_tokenizer, tiny_model


def test_problems_are_seeded_disjoint_and_well_formed():
    train, test = make_problems(300, 50, digits=2, seed=3)
    assert (train, test) == make_problems(300, 50, digits=2, seed=3)
    assert make_problems(300, 50, digits=2, seed=4) != (train, test)
    assert len(set(train)) == 300 and len(set(test)) == 50 and not set(train) & set(test)
    for p in train + test:
        assert 0 <= p.a <= 99 and 0 <= p.b <= 99 and p.op in "+-"
        assert p.answer >= 0  # subtraction keeps results non-negative by default
        assert p.prompt == f"What is {p.a}{p.op}{p.b}?" and p.completion == f"\\boxed{{{p.answer}}}"
    assert {p.op for p in train} == {"+", "-"}
    three, _ = make_problems(100, 0, digits=3, ops=("+",), seed=0)
    assert max(max(p.a, p.b) for p in three) >= 100 and {p.op for p in three} == {"+"}
    negative, _ = make_problems(200, 0, ops=("-",), allow_negative=True)
    assert any(p.answer < 0 for p in negative)
    assert ArithmeticProblem(47, 35, "+").prompt == "What is 47+35?"
    assert ArithmeticProblem(47, 35, "+").completion == "\\boxed{82}"


def test_problem_space_and_argument_errors():
    make_problems(10 * 10 + 55 - 5, 5, digits=1)  # exactly the whole 1-digit space
    with pytest.raises(ValueError, match="distinct problems"):
        make_problems(10 * 10 + 55, 1, digits=1)
    with pytest.raises(ValueError, match="ops"):
        make_problems(1, 1, ops=("*",))
    with pytest.raises(ValueError, match="digits"):
        make_problems(1, 1, digits=0)
    # "" passed the substring check ("What is 5138?" with the gold 51-38=13); negative counts sliced silently
    with pytest.raises(ValueError, match="ops must be"):
        make_problems(1, 1, ops=("+", ""))
    with pytest.raises(ValueError, match="num_test must be an integer >= 0, got -1"):
        make_problems(10, -1)
    with pytest.raises(ValueError, match="num_train must be an integer >= 0, got -5"):
        make_problems(-5, 10)


def test_datasets_come_in_trl_formats():
    problems, _ = make_problems(4, 0, seed=1)
    conv = to_dataset(problems, "conversational")
    assert is_conversational(conv[0]) and set(conv.column_names) == {"prompt", "completion", "answer", "solution"}
    assert conv[0]["prompt"] == [{"role": "user", "content": problems[0].prompt}]
    assert conv[0]["completion"] == [{"role": "assistant", "content": problems[0].completion}]
    plain = to_dataset(problems, "prompt_completion")
    assert not is_conversational(plain[0]) and plain[0]["prompt"].endswith("\n")
    text = to_dataset(problems, "text")
    assert text.column_names == ["text", "answer", "solution"]
    assert text[0]["text"] == f"{problems[0].prompt}\n{problems[0].completion}"
    assert conv[0]["answer"] == str(problems[0].answer) and conv[0]["solution"] == problems[0].completion
    with pytest.raises(ValueError, match="dataset_format"):
        to_dataset(problems, "csv")


def test_exact_match_scorer():
    assert score_completion("\\boxed{82}", 82)
    assert score_completion("so 47+35 = \\boxed{ 82 }", "82")
    assert score_completion([{"role": "assistant", "content": "\\boxed{0}"}], 0)
    assert score_completion("\\boxed{1} no wait \\boxed{82}", 82)  # the last box counts
    assert not score_completion("82", 82)  # the answer must be boxed
    assert not score_completion("\\boxed{820}", 82)
    assert not score_completion("\\boxed{-82}", 82)
    assert not score_completion("", 82) and not score_completion([], 82)
    assert extract_boxed("\\boxed{7}") == "7" and extract_boxed("nothing") is None


class OracleModel(torch.nn.Module):
    """Answers every "What is a+b?" prompt it can read (wrong on odd ``a`` if ``flaky``); records its inputs."""

    block_size = None

    def __init__(self, tokenizer, flaky=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer, self.flaky, self.calls = tokenizer, flaky, []

    def generate(self, input_ids, attention_mask=None, **kwargs):
        self.calls.append((input_ids, attention_mask, kwargs))
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            text = self.tokenizer.decode(ids[mask.bool()])
            a, op, b = text.split("What is ")[1].split("?")[0].partition("+" if "+" in text else "-")
            answer = int(a) + int(b) if op == "+" else int(a) - int(b)
            if self.flaky and int(a) % 2:
                answer += 1
            completion = self.tokenizer.encode(f"\\boxed{{{answer}}}", add_special_tokens=False) + [IM_END_ID]
            completion += [EOS_ID] * (kwargs["max_new_tokens"] - len(completion))
            rows.append(torch.cat([ids, torch.tensor(completion)]))
        return torch.stack(rows)


def test_evaluate_accuracy_uses_chat_template_left_padding_and_greedy_batches():
    tokenizer = build_tokenizer()
    tokenizer.padding_side = "right"
    problems = [ArithmeticProblem(7, 5, "+"), ArithmeticProblem(47, 35, "+"), ArithmeticProblem(90, 9, "-")]
    oracle = OracleModel(tokenizer)
    assert evaluate_accuracy(oracle, tokenizer, problems, batch_size=2) == 1.0
    assert len(oracle.calls) == 2  # batches of 2 and 1
    ids, mask, kwargs = oracle.calls[0]
    assert kwargs["temperature"] == 0.0 and kwargs["max_new_tokens"] == 16
    assert mask[0, 0] == 0 and mask[:, -1].all()  # left padding
    assert tokenizer.decode(ids[1]).startswith("<|im_start|>user\nWhat is 47+35?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.padding_side == "right"  # restored
    flaky = [ArithmeticProblem(a, 1, "+") for a in range(4)]
    assert evaluate_accuracy(OracleModel(tokenizer, flaky=True), tokenizer, flaky) == 0.5
    assert evaluate_accuracy(oracle, tokenizer, problems[:1], max_new_tokens=12) == 1.0
    assert oracle.calls[-1][2]["max_new_tokens"] == 12
    assert oracle.calls[-1][2]["block_length"] == 16 and oracle.calls[-1][2]["denoising_steps"] == 16
    evaluate_accuracy(oracle, tokenizer, problems[:1], block_length=4)  # one token per step by default
    assert oracle.calls[-1][2]["block_length"] == 4 and oracle.calls[-1][2]["denoising_steps"] == 4
    with pytest.raises(ValueError, match="no problems"):
        evaluate_accuracy(oracle, tokenizer, [])


def test_evaluate_accuracy_runs_a_real_model(family, monkeypatch):
    """A real model: the texts evaluate_accuracy scores are the greedy completions each chat-formatted prompt gets
    alone (its batching and left padding change nothing), and the accuracy is the fraction of them that is right;
    training mode is restored."""
    from trl_diffusion.data import arithmetic

    model = tiny_model(family)
    model.train()
    tokenizer = build_tokenizer()
    _, test = make_problems(0, 3, seed=0)
    scored = []
    score = arithmetic.score_completion
    monkeypatch.setattr(arithmetic, "score_completion", lambda text, gold: scored.append(text) or score(text, gold))
    settings = dict(max_new_tokens=8, block_length=4, denoising_steps=4)
    with DecisionMargins() as margins:
        accuracy = evaluate_accuracy(model, tokenizer, test, **settings)
    assert margins.smallest > MIN_MARGIN
    assert model.training  # training mode restored
    alone = []
    for problem in test:
        text = tokenizer.apply_chat_template([{"role": "user", "content": problem.prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        out = model.generate(ids, temperature=0.0, remasking_strategy="low_confidence_static", **settings)
        tokens = out[0, ids.shape[1]:].tolist()
        end = next((i for i, t in enumerate(tokens) if t in tokenizer.all_special_ids), len(tokens))
        alone.append(tokenizer.decode(tokens[:end]))
    assert scored == alone and any(alone)
    assert accuracy == sum(score(t, p.answer) for t, p in zip(alone, test)) / len(test)
