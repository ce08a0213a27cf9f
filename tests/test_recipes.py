"""Recipes: each parses into the config classes its example targets, says which official config it mirrors, never
trains on an evaluation set, and the TraDo-4B recipe carries the official run's values."""

from pathlib import Path

import pytest
import yaml
from example_scripts import load_example

from trl_diffusion.eval.datasets import HUB_DATASETS
from trl_diffusion.trainers.tracerl_config import OFFICIAL_SETTINGS, TraceRLConfig

ROOT = Path(__file__).parent.parent
RECIPES = sorted((ROOT / "trl_diffusion" / "recipes").glob("*.yaml"))

# evaluation sets: the benchmarks trl-diffusion eval loads, and dLLM-RL's evaluation copies (data/download_data.py)
DLLM_RL_EVALUATION = ("math500", "gsm8k", "aime2024", "livebench", "livecodebench", "mbpp", "humaneval")
EVALUATION_SETS = ({name.lower() for name in HUB_DATASETS} | {repo.lower() for repo, _, _ in HUB_DATASETS.values()}
                   | {f"gen-verse/{name}" for name in DLLM_RL_EVALUATION})


def example_module(recipe: Path):
    """The example the recipe is launched with (examples/sft.py, code.py or math.py), imported."""
    name = "sft" if "sft" in recipe.stem else "code" if "code" in recipe.stem else "math"
    return load_example(name)


def example_parser(recipe: Path):
    """The TrlParser of the example the recipe is launched with."""
    return example_module(recipe).make_parser()


def parse(recipe: Path):
    parser = example_parser(recipe)
    return parser.parse_args_and_config(["--config", str(recipe), "--bf16", "false", "--tf32", "false",
                                         "--use_cpu", "true"])


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_parses_and_states_what_it_mirrors(recipe):
    script_args, training_args, model_args = parse(recipe)
    assert model_args.model_name_or_path and training_args.output_dir.startswith("outputs/")
    header = "".join(line for line in recipe.read_text().splitlines(keepends=True) if line.startswith("#"))
    assert "mirroring" in header and "Deviations" in header
    # every key of the file reached a config field (a misspelt key would be silently ignored otherwise)
    fields = {**vars(script_args), **vars(training_args), **vars(model_args)}
    assert set(yaml.safe_load(recipe.read_text())) <= set(fields)
    # the released checkpoints are bf16 and dLLM-RL loads them so (torch_dtype "auto" / bf16); the SFT recipe
    # loaded float32 (TRL's default), unlike the docs' "the recipes set bfloat16"
    assert model_args.dtype == "bfloat16"


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_no_recipe_trains_on_an_evaluation_set(recipe):
    script_args, _, _ = parse(recipe)
    name = (getattr(script_args, "dataset_name", None) or "").lower()
    assert name not in EVALUATION_SETS and "math-500" not in name and "math500" not in name
    if name:
        assert script_args.dataset_train_split != "test"


def test_trado_4b_recipe_is_the_official_run():
    """Gen-Verse/dLLM-RL configs/rl_trado.yaml + rl_trado_with_value.yaml, as the published TraDo-4B run."""
    recipe = ROOT / "trl_diffusion" / "recipes" / "trado_4b_tracerl_math.yaml"
    script_args, args, model_args = parse(recipe)
    assert model_args.model_name_or_path == "Gen-Verse/TraDo-4B-Instruct"
    assert (script_args.dataset_name, script_args.dataset_train_split) == ("Gen-Verse/MATH_train", "train")
    assert script_args.reward_funcs == ["official_math_reward"]
    assert script_args.prompt_template == ("<|im_start|>user\n{question}\nPlease reason step by step, and put your "
                                           "final answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant")
    assert script_args.value_model == "Gen-Verse/TraDo-4B-Instruct"
    # 64 prompts x 16 responses per rollout, 80 rollouts of 16 optimizer steps on 8 GPUs
    assert (args.num_generations, args.generation_batch_size) == (16, 1024)
    optimizer_batch = args.per_device_train_batch_size * 8 * args.gradient_accumulation_steps
    assert optimizer_batch == 64 and args.max_steps == 80 * (1024 // optimizer_batch)
    official = dict(block_length=4, denoising_steps=4, remasking_strategy="low_confidence_dynamic",
                    confidence_threshold=0.9, temperature=1.0, top_k=0, top_p=1.0, max_completion_length=2000,
                    learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9,
                    adam_beta2=0.999, weight_decay=0.0, epsilon=0.2, beta=0.01, kl_reference="old_policy",
                    max_grad_norm=1.0, value_learning_rate=5e-6, gamma=1.0, lam=1.0, shrinkage=1,
                    dynamic_group_filtering="accuracy_band", group_accuracy_low=0.2, group_accuracy_high=0.8,
                    step_normalization="max_length", loss_type="tracerl", gradient_checkpointing=True)
    assert {k: getattr(args, k) for k in official} == official
    assert args.lr_scheduler_type == "constant"  # HF's enum compares equal to its name
    assert yaml.safe_load(recipe.read_text())["bf16"] is True and "deepspeed_zero3" in recipe.read_text()
    # and every objective setting of the preset
    preset = OFFICIAL_SETTINGS["trado"]
    assert {k: getattr(args, k) for k in preset} == preset


@pytest.mark.parametrize("name", ["dream", "llada"])
def test_dream_and_llada_recipes_carry_their_official_settings(name):
    recipe = next(r for r in RECIPES if r.stem.startswith(name))
    _, args, _ = parse(recipe)
    preset = OFFICIAL_SETTINGS[name]
    assert {k: getattr(args, k) for k in preset} == preset
    assert isinstance(args, TraceRLConfig)


OFFICIAL_REWARD_RECIPES = [r for r in RECIPES if "official_math_reward" in r.read_text()]


@pytest.mark.parametrize("recipe", OFFICIAL_REWARD_RECIPES, ids=[r.stem for r in OFFICIAL_REWARD_RECIPES])
def test_recipe_reward_scores_truncated_responses_wrong(recipe):
    """dLLM-RL's reward (rl_reward.py 99-103): a response of at least max_token - 5 tokens scores 0, with max_token
    the run's response limit -- as examples/math.py loads the recipe's reward, at the recipe's
    max_completion_length."""
    script_args, args, _ = parse(recipe)
    limit = args.max_completion_length
    reward = example_module(recipe).load_reward("official_math_reward", limit)
    assert reward.__name__ == "official_math_reward"
    ids = [[7] * (limit - 5), [7] * (limit - 6)]
    assert reward(["so \\boxed{4}"] * 2, completion_ids=ids, answer=["4", "4"]) == [0.0, 1.0]
    assert "official_math_reward" in script_args.reward_funcs
