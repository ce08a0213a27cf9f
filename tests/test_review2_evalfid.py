"""Evaluation fidelity against dLLM-RL's published evaluation (Gen-Verse/dLLM-RL ``eval.py``, ``sample/*_sample.py``,
``reward/reward.py``): grading, prompts and metrics, on small rows in the real benchmark formats."""

import importlib
import json
from pathlib import Path

import pytest

from trl_diffusion.eval import evaluate, load_eval_problems, problems_from_rows, score_completions
from trl_diffusion.rewards import OfficialMathReward
from trl_diffusion.testing import build_tokenizer, tiny_model

FAST = dict(max_new_tokens=8, block_length=4, denoising_steps=4, progress=False, output_dir=None)

# A few rows in the real formats, picked for their edge cases (GSM8K thousands separators and negatives, AIME
# leading zeros, MATH-500 \text{}, degrees, intervals, units).
GSM8K_ROWS = [
    {"question": "How many dollars?", "answer": "He pays 5*425=<<5*425=2125>>2,125.\n#### 2,125"},
    {"question": "How much did she lose?", "answer": "So 5-15=<<5-15=-10>>-10\n#### -10"},
]
AIME_ROWS = [{"id": 67, "problem": "Find m+n.", "answer": "025"}, {"id": 84, "problem": "Find N.", "answer": "033"}]
MATH500_ROWS = [
    {"problem": "Which choice?", "answer": "\\text{(C)}"},
    {"problem": "Find the angle.", "answer": "90^\\circ"},
    {"problem": "Find the angle.", "answer": "\\frac{270}7\\text{ degrees}"},
    {"problem": "Solve.", "answer": "x \\in [-2,7]"},
    {"problem": "How much?", "answer": "5.4 \\text{ cents}"},
]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model("sdar", max_position_embeddings=2048), build_tokenizer()


# ---------------------------------------------------------------------------------------------- math grading
def _verdicts(rows, completions, grader=None):
    problems = problems_from_rows(rows)
    return [r["reward"] for r in score_completions(problems, completions, math_reward=grader)]


def test_gold_answers_of_the_edge_cases():
    assert [p.answer for p in problems_from_rows(GSM8K_ROWS)] == ["2125", "-10"]
    assert [p.answer for p in problems_from_rows(AIME_ROWS)] == ["025", "033"]  # kept as written; graded as numbers


def test_official_grader_scores_as_dllm_rl():
    """dLLM-RL's eval (reward/reward.py -> math_utils.is_equal on the last \\boxed{}) against math-verify on the same
    completions: a completion without a box is wrong there, and unit words are dropped (Minerva's normalisation)."""
    official = OfficialMathReward()
    no_box = ["She makes 5 * 425 = 2,125 dollars.", "The loss is -10."]
    assert _verdicts(GSM8K_ROWS, no_box) == [1.0, 1.0]  # math-verify extracts the last number of the text
    assert _verdicts(GSM8K_ROWS, no_box, official) == [0.0, 0.0]
    words = ["\\boxed{2125 dollars}", "\\boxed{-10 dollars}"]
    assert _verdicts(GSM8K_ROWS, words) == [0.0, 0.0]
    assert _verdicts(GSM8K_ROWS, words, official) == [1.0, 1.0]
    for grader in (None, official):  # what both accept
        assert _verdicts(GSM8K_ROWS, ["\\boxed{2,125}", "\\boxed{-10}"], grader) == [1.0, 1.0]
        assert _verdicts(AIME_ROWS, ["\\boxed{25}", "\\boxed{033}"], grader) == [1.0, 1.0]
        assert _verdicts(MATH500_ROWS, ["\\boxed{(C)}", "\\boxed{90}", "\\boxed{\\frac{270}7\\text{ degrees}}",
                                        "\\boxed{x \\in [-2,7]}", "\\boxed{5.4}"], grader) == [1.0] * 5
    # where they differ on MATH-500's gold answers: a bare letter, braces the gold leaves out (dLLM-RL's own
    # function gives False for \frac{270}{7} against \frac{270}7\text{ degrees}), the bare interval
    differ = ["\\boxed{C}", "\\boxed{90}", "\\boxed{\\frac{270}{7}}", "\\boxed{[-2,7]}", "\\boxed{5.4}"]
    assert _verdicts(MATH500_ROWS, differ) == [1.0] * 5
    assert _verdicts(MATH500_ROWS, differ, official) == [0.0, 1.0, 0.0, 0.0, 1.0]
    # the prediction reported is the grader's own: dLLM-RL reads \boxed{ only, not \fbox{
    problems = problems_from_rows(AIME_ROWS[:1])
    assert score_completions(problems, ["\\fbox{25}"])[0]["prediction"] == "25"
    assert score_completions(problems, ["\\fbox{25}"], math_reward=official)[0]["prediction"] is None
    official.close()


def test_evaluate_uses_the_chosen_grader(model_and_tokenizer, monkeypatch):
    ev = importlib.import_module("trl_diffusion.eval.evaluate")
    model, tokenizer = model_and_tokenizer
    # every completion reads as a boxless text whose last number is the gold answer
    monkeypatch.setattr(ev, "_completion",
                        lambda tokenizer, tokens, committed, stop_ids: ("So the total is 2,125.", 5, False))
    rows = GSM8K_ROWS[:1]
    default = evaluate(model=model, tokenizer=tokenizer, dataset=rows, temperature=0.0, **FAST)
    official = evaluate(model=model, tokenizer=tokenizer, dataset=rows, temperature=0.0, math_grader="official",
                        **FAST)
    assert default["math_grader"] == "math_verify" and default["metrics"]["accuracy"] == 1.0
    assert official["math_grader"] == "official" and official["metrics"]["accuracy"] == 0.0
    assert official["metrics"]["boxed_rate"] == 0.0
    with pytest.raises(ValueError, match="math_grader"):
        evaluate(model=model, tokenizer=tokenizer, dataset=rows, math_grader="sympy", **FAST)


def test_local_file_rows_keep_their_gold(tmp_path):
    path = tmp_path / "aime.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in AIME_ROWS) + "\n")
    _, problems = load_eval_problems(str(path))
    assert [p.id for p in problems] == ["67", "84"] and [p.answer for p in problems] == ["025", "033"]


def test_cli_takes_the_grader(capsys):
    from trl_diffusion.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--math_grader", "sympy", "--progress", "false"])
    assert exit_info.value.code == 2 and "math_grader" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "--math_grader" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- prompts
# dLLM-RL's math prompts as its sample scripts write them (jinja2 templates, rendered with problem=...).
OFFICIAL_JINJA = {
    "dllm_rl_sdar": "<|im_start|>user\n{{problem}}\nPlease reason step by step, and put your final answer within "
                    "\\boxed{}.<|im_end|>\n<|im_start|>assistant\n",
    "dllm_rl_sdar_think": "<|im_start|>user\nYou need to put your final answer in \\boxed{}. This is the problem:\n"
                          "{{problem}}<|im_end|>\n<|im_start|>assistant<think>\n",
    "dllm_rl_llada": "<|startoftext|><|start_header_id|>user<|end_header_id|>You need to put your final answer in "
                     "\\boxed{}. This is the problem:\n{{problem}}<|eot_id|><|startoftext|><|start_header_id|>"
                     "assistant<|end_header_id|>\n",
    "dllm_rl_dream": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nYou need to put "
                     "your final answer in \\boxed{}. This is the problem:\n{{problem}}<|im_end|>\n"
                     "<|im_start|>assistant\n",
}


@pytest.mark.parametrize("name", sorted(OFFICIAL_JINJA))
def test_prompt_presets_are_dllm_rl_prompts_as_rendered(name):
    """jinja2 drops a template's final newline (keep_trailing_newline=False), so dLLM-RL's prompts end at
    ``assistant``: the preset must be the rendered text, character for character."""
    from jinja2 import Template

    from trl_diffusion.eval import PROMPT_PRESETS

    question = "What is $1+1$? {x}\n"
    rendered = Template(OFFICIAL_JINJA[name]).render(problem=question)
    assert not rendered.endswith("\n")
    assert PROMPT_PRESETS[name].replace("{question}", question) == rendered
    problems = problems_from_rows([{"question": question, "answer": "2"}], prompt_template=name)
    assert problems[0].prompt == rendered


def test_evaluate_feeds_a_preset_without_the_chat_template(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    seen = []
    ev = importlib.import_module("trl_diffusion.eval.evaluate")
    real = ev.score_completions

    def spy(problems, completions, *args):
        seen.extend(problems)
        return real(problems, completions, *args)

    rows = GSM8K_ROWS[:1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ev, "score_completions", spy)
        report = evaluate(model=model, tokenizer=tokenizer, dataset=rows, prompt_template="dllm_rl_sdar",
                          temperature=0.0, **FAST)
    assert report["apply_chat_template"] is False
    assert seen[0].prompt == "<|im_start|>user\nHow many dollars?\nPlease reason step by step, and put your " \
                                    "final answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant"
    with pytest.raises(ValueError, match="whole prompt"):
        evaluate(model=model, tokenizer=tokenizer, dataset=rows, prompt_template="dllm_rl_sdar",
                 apply_chat_template=True, **FAST)
    with pytest.raises(ValueError, match="dllm_rl_sdar_think"):
        evaluate(model=model, tokenizer=tokenizer, dataset=rows, prompt_template="dllm_rl_sdar",
                 start_with_think=True, **FAST)



def test_recipes_use_dllm_rl_prompts_as_rendered():
    """The TraceRL recipes train on dLLM-RL's rollout prompts (the same templates as its eval scripts)."""
    import yaml

    from trl_diffusion.eval import PROMPT_PRESETS

    recipes = Path(__file__).parents[1] / "trl_diffusion" / "recipes"
    family = {"trado_4b": "dllm_rl_sdar", "trado_8b": "dllm_rl_sdar", "llada_8b": "dllm_rl_llada",
              "dream_7b": "dllm_rl_dream"}
    checked = 0
    for path in sorted(recipes.glob("*_tracerl_math.yaml")):
        template = yaml.safe_load(path.read_text()).get("prompt_template")
        key = next(v for k, v in family.items() if path.name.startswith(k))
        assert template == PROMPT_PRESETS[key], path.name
        checked += 1
    assert checked == 4
