"""``rollout/sampler_logp_gap(_exact)`` compares the trainer's log-probs with the sampler's, so it is measured only
where the trainer scores with the weights that sampled the rollout: the micro-batches of the first optimizer step
after it. Averaged over later steps too (``num_iterations`` > 1, several steps per rollout), it read 0.6-0.7 on the
embedded model where rollout and trainer agree, which the FAQ calls a disagreement."""

from trl_diffusion import TraceRLConfig, TraceRLTrainer
from trl_diffusion.assets import EMBEDDED_FORMAT, EMBEDDED_MODEL, EMBEDDED_TASK
from trl_diffusion.data import make_problems, to_dataset
from trl_diffusion.rewards import math_accuracy_reward

GAPS = ("rollout/sampler_logp_gap", "rollout/sampler_logp_gap_exact")


def test_the_gap_is_measured_with_the_rollouts_weights_only(tmp_path):
    train, _ = make_problems(**EMBEDDED_TASK)
    args = TraceRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_steps=6,
                         logging_steps=1, num_generations=8, per_device_train_batch_size=8,
                         gradient_accumulation_steps=2, steps_per_generation=4, num_iterations=2,
                         max_completion_length=8, block_length=4, denoising_steps=4,
                         learning_rate=3e-3, dynamic_group_filtering="none", save_strategy="no")
    trainer = TraceRLTrainer(str(EMBEDDED_MODEL), math_accuracy_reward, args=args,
                             train_dataset=to_dataset(train[:64], EMBEDDED_FORMAT))
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    # a rollout every 4 optimizer steps (2 per generation batch x 2 iterations): steps 1 and 5 are fresh
    assert [bool(set(GAPS) & set(entry)) for entry in steps] == [True, False, False, False, True, False]
    assert all(entry[name] < 1e-4 for entry in steps for name in GAPS if name in entry)


def train_with_alternating_rewards(tmp_path, prompts: int, **config) -> list[dict]:
    """The embedded model trained on ``prompts`` problems with rewards alternating 0 / 1 (every group learns); the
    log entries of its optimizer steps."""
    train, _ = make_problems(**EMBEDDED_TASK)
    flips = iter(range(10**6))
    args = TraceRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", logging_steps=1,
                         num_generations=4, per_device_train_batch_size=4, max_completion_length=8, block_length=4,
                         denoising_steps=4, dynamic_group_filtering="none", save_strategy="no", **config)
    trainer = TraceRLTrainer(str(EMBEDDED_MODEL), lambda completions, **kw: [float(next(flips) % 2)
                                                                               for _ in completions],
                             args=args, train_dataset=to_dataset(train[:prompts], EMBEDDED_FORMAT))
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_a_rollout_made_inside_an_optimizer_step_counts_that_step_only(tmp_path):
    """steps_per_generation=3 with gradient_accumulation_steps=2: the second rollout is made at micro-batch 3, in the
    middle of optimizer step 2 (whose micro-batch 2 still scored the first rollout with moved weights); micro-batch 4
    belongs to step 3, scored after that step's update (a gap of 1.15 was logged there)."""
    steps = train_with_alternating_rewards(tmp_path, 32, max_steps=3, gradient_accumulation_steps=2,
                                           steps_per_generation=3, learning_rate=1e-2)
    assert [bool(set(GAPS) & set(entry)) for entry in steps] == [True, True, False]
    assert all(entry[name] < 1e-4 for entry in steps for name in GAPS if name in entry)


def test_an_epoch_ending_in_a_short_accumulation_window_moves_the_boundaries(tmp_path):
    """transformers ends an epoch whose micro-batches are not a multiple of ``gradient_accumulation_steps`` with a
    shorter optimizer step and starts the next epoch's windows afresh. Here an epoch is 4 micro-batches (windows of 3
    and 1) with a rollout every 2: steps 1 and 3 score fresh rollouts only, steps 2 and 4 (one micro-batch each) the
    previous step's rollout with moved weights. Counting windows of 3 from the start of the run, step 4 had been
    measured (micro-batch 7 taken for step 3's), logging a gap of 0.05-0.3 for weights that had moved."""
    steps = train_with_alternating_rewards(tmp_path, 4, max_steps=4, gradient_accumulation_steps=3,
                                           steps_per_generation=2, learning_rate=3e-3)
    assert [entry["epoch"] for entry in steps] == [0.75, 1.0, 1.75, 2.0]  # the windows described above
    assert [bool(set(GAPS) & set(entry)) for entry in steps] == [True, False, True, False]
    assert all(entry[name] < 1e-4 for entry in steps for name in GAPS if name in entry)
