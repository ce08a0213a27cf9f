"""DiffusionValueTrainer audit: its loss equals a slow per-row, per-state computation on stored trajectories of
different prompt and canvas lengths; a row with nothing committed is refused up front (it used to crash
``backward``); the logged explained variance is that of every trained token of the logging window (it used to be
NaN whenever a micro-batch held one rollout)."""

import copy

import pytest
import torch
from datasets import Dataset

from trl_diffusion.states import (
    attention_mask_from_positions,
    positions_from_padding,
    state_before_step,
    trajectory_groups,
)
from trl_diffusion.testing import EOS_ID, MASK_ID, build_tokenizer, tiny_model
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer, token_values

ROWS = {  # stored rollouts: block-monotone steps (as the samplers record them), a never-committed tail, an EOS
    "prompt_ids": [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15], [16]],
    "completion_ids": [[20, 21, EOS_ID, 23, 24], [25, 26, 27], [28, 29, 30, 31, 32, 33, 34], [35, 36, 37, 38]],
    "unmask_step": [[0, 1, 1, 3, 2], [0, 0, 1], [0, 1, 3, 2, 4, 5, -1], [1, 0, 2, -1]],
    "reward": [1.0, -0.5, 0.3, 2.0],
}


def args_for(tmp_path, **overrides):
    fields = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
                  save_strategy="no", disable_tqdm=True, logging_steps=1)
    return DiffusionValueConfig(**{**fields, **overrides})


def value_model(family, seed=0):
    value = DiffusionValueModel.from_policy(tiny_model(family, seed=1))
    with torch.no_grad():
        value.value_head.weight.normal_(generator=torch.Generator().manual_seed(seed))
    return value


def slow_row(value, prompt, canvas, steps, shrinkage, gamma, reward):
    """One rollout alone: one whole-sequence forward per merged step, the value read at the token's position;
    returns R_j = r_j + gamma R*_{t+1} over the steps of the trained tokens (up to the first committed EOS)."""
    block = 4 if value.block_size is not None else None
    ids = torch.tensor([prompt + canvas])
    groups = trajectory_groups(torch.tensor([steps]), torch.ones(1, len(prompt), dtype=torch.long), shrinkage, block)
    full = torch.cat([torch.full((1, len(prompt)), -1), groups], 1)
    generated = torch.tensor([[False] * len(prompt) + [True] * len(canvas)])
    valid = torch.ones_like(generated)
    positions = positions_from_padding(valid)
    attention = attention_mask_from_positions(positions, positions, valid, block)
    values = torch.zeros(ids.shape)
    for g in range(int(groups.max()) + 1):
        state = state_before_step(ids, full, generated, g, MASK_ID)
        out = value(input_ids=state, attention_mask=attention, position_ids=positions).value
        values = torch.where(full == g, out, values)
    values, groups = values[0, len(prompt):].tolist(), groups[0].tolist()
    trained, stopped = [], False
    for token, step in zip(canvas, steps):
        trained.append(step >= 0 and not stopped)
        stopped = stopped or (step >= 0 and token == EOS_ID)
    order = sorted({g for g, t in zip(groups, trained) if t})
    later = [gamma ** (len(order) - 1 - i) * reward for i in range(len(order))]  # R*_t, reward on the last step
    terms = []
    for v, g, t in zip(values, groups, trained):
        if t:
            i = order.index(g)
            target = reward if i == len(order) - 1 else gamma * later[i + 1]
            terms.append(0.5 * (v - target) ** 2)
    return terms


@pytest.mark.parametrize("family", ["sdar", "dream"])  # block-causal, and full attention with shifted logits
def test_value_loss_equals_a_slow_per_row_per_state_computation(tmp_path, family):
    value = value_model(family).eval()
    args = args_for(tmp_path, per_device_train_batch_size=4, shrinkage=2, gamma=0.7, scoring_token_budget=20)
    trainer = DiffusionValueTrainer(value, args=args, train_dataset=Dataset.from_dict(ROWS),
                                    processing_class=build_tokenizer())
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    with torch.no_grad():
        fast = trainer.compute_loss(value, batch).item()
        terms = [t for p, c, s, r in zip(*ROWS.values()) for t in slow_row(value, p, c, s, 2, 0.7, r)]
    assert fast == pytest.approx(sum(terms) / len(terms), rel=1e-5)


@pytest.mark.parametrize("steps, canvas", [([-1, -1, -1], [20, 21, 22]), ([], [])])
def test_a_row_with_nothing_committed_is_refused_before_training(tmp_path, steps, canvas):
    """Such a row has no trained token: a micro-batch of them gave a loss without a graph, and train() failed in
    backward with 'element 0 of tensors does not require grad'."""
    rows = {"prompt_ids": [[5, 6], [7]], "completion_ids": [[20, 21], canvas], "unmask_step": [[0, 1], steps],
            "reward": [1.0, 0.5]}
    with pytest.raises(ValueError, match=r"row 1: no completion token was committed"):
        DiffusionValueTrainer(value_model("sdar"), args=args_for(tmp_path), train_dataset=Dataset.from_dict(rows),
                              processing_class=build_tokenizer())


def test_logged_explained_variance_covers_every_token_of_the_window(tmp_path):
    """One rollout per micro-batch (gradient accumulation 2): each micro-batch's returns are constant (gamma = 1),
    so its own explained variance is NaN, and the logged one was NaN at every step; now it is 1 - Var(R - V) /
    Var(R) over the trained tokens of both micro-batches, and the mean value is the token mean."""
    rows = {k: v[:2] for k, v in ROWS.items()}
    value = value_model("sdar", seed=3)
    before = copy.deepcopy(value).eval()
    args = args_for(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=1)
    trainer = DiffusionValueTrainer(value, args=args, train_dataset=Dataset.from_dict(rows),
                                    processing_class=build_tokenizer())
    trainer.train()
    logged = trainer.state.log_history[0]
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    with torch.no_grad():
        values, _ = token_values(before, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                 batch["unmask_step"], completion_mask=batch["completion_mask"])
    trained = batch["trained_mask"]
    v = values[trained].double()
    r = batch["reward"][:, None].expand_as(values)[trained].double()
    explained = 1 - (r - v).var(unbiased=False) / r.var(unbiased=False)
    assert logged["value/explained_variance"] == pytest.approx(explained.item(), rel=1e-4)
    assert logged["value/mean"] == pytest.approx(v.mean().item(), rel=1e-4, abs=1e-6)


def test_a_trajectory_with_an_uncommitted_gap_is_refused():
    """-1 before a committed column: no sampler writes it, and the packed scoring would show the stored token there
    where the docs promise a mask; refused when the dataset is prepared, naming the row and column."""
    from trl_diffusion.value.value_trainer import _prepare_dataset

    rows = {"prompt_ids": [[5, 6, 7], [8, 9]], "completion_ids": [[10, 11, 12, 13], [14, 15, 16]],
            "unmask_step": [[0, 0, -1, -1], [0, -1, 1]], "reward": [1.0, 0.0]}
    with pytest.raises(ValueError, match="row 1: 'unmask_step' is -1 at column 1, before committed column 2"):
        _prepare_dataset(Dataset.from_dict(rows), build_tokenizer())
    rows["unmask_step"][1] = [0, 1, -1]
    assert len(_prepare_dataset(Dataset.from_dict(rows), build_tokenizer())) == 2


def test_gradient_accumulation_trains_as_the_whole_batch(tmp_path):
    """The loss is the token mean over the accumulated batch (transformers' convention for label tokens): one SGD step
    on rows with 3 and 6 trained tokens, batch 1 x accumulation 2, equals batch 2 (it was the mean of the two
    micro-batch means before)."""
    rows = {k: v[1:3] for k, v in ROWS.items()}
    trained = []
    for layout, (batch, accumulation) in {"whole": (2, 1), "accumulated": (1, 2)}.items():
        value = value_model("sdar", seed=5)
        args = args_for(tmp_path / layout, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                        max_steps=1, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0)
        trainer = DiffusionValueTrainer(value, args=args, train_dataset=Dataset.from_dict(rows),
                                        processing_class=build_tokenizer())
        trainer.train()
        trained.append((trainer.state.log_history[0]["loss"], value.state_dict()))
    (whole_loss, whole), (accumulated_loss, accumulated) = trained
    assert accumulated_loss == pytest.approx(whole_loss, rel=1e-5)
    initial = value_model("sdar", seed=5).state_dict()
    largest = max((whole[k] - initial[k]).abs().max().item() for k in whole)
    assert largest > 1e-3  # the step moved the weights
    for name in whole:  # the two updates agree to float32 summation-order noise, relative to the update's size
        torch.testing.assert_close(accumulated[name] - initial[name], whole[name] - initial[name], rtol=1e-3,
                                   atol=1e-4 * largest)


def test_values_under_a_larger_training_block_do_not_depend_on_never_committed_columns():
    # training block 8 over rollout blocks of 4: the columns after a row's last committed token (after its stop, or
    # the batch's padding) were shown as masks, so a row's values changed with its batch; the policy's trajectory
    # estimator leaves them out (row_canvas), and the value model must read the same states
    policy = tiny_model("sdar", seed=1)
    value = DiffusionValueModel.from_policy(policy).eval()
    with torch.no_grad():
        value.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
    prompt = torch.arange(5, 13)[None]
    canvas, steps = torch.tensor([[20, 21, 22, EOS_ID]]), torch.tensor([[0, 1, 1, 0]])
    wider = torch.cat([canvas, torch.full((1, 4), EOS_ID)], 1), torch.cat([steps, torch.full((1, 4), -1)], 1)
    with torch.no_grad():
        alone, _ = token_values(value, prompt, torch.ones_like(prompt), canvas, steps, 1, 8)
        in_batch, _ = token_values(value, prompt, torch.ones_like(prompt), *wider, 1, 8)
    assert torch.allclose(alone, in_batch[:, :4], rtol=1e-5, atol=1e-5 * float(alone.abs().max()))
    assert (in_batch[:, 4:] == 0).all()


def test_a_value_row_no_rollout_could_produce_is_refused():
    """The value trainer accepted an empty prompt and a prompt + completion longer than the model's positions, which
    TraceRL's rollouts refuse: the value model was fit on trajectories the policy never produces."""
    from trl_diffusion.value.value_trainer import _prepare_dataset

    rows = {"prompt": ["", "abc"], "completion_ids": [[10, 11], [12, 13]], "unmask_step": [[0, 1], [0, 1]],
            "reward": [1.0, 0.0]}
    with pytest.raises(ValueError, match="row 0: the prompt is empty"):
        _prepare_dataset(Dataset.from_dict(rows), build_tokenizer())
    rows = {"prompt_ids": [[5, 6, 7]], "completion_ids": [[10, 11, 12]], "unmask_step": [[0, 1, 2]], "reward": [1.0]}
    with pytest.raises(ValueError, match=r"row 0: prompt \(3\) \+ completion \(3\) = 6 tokens exceed the model's 5"):
        _prepare_dataset(Dataset.from_dict(rows), build_tokenizer(), max_positions=5)
    assert len(_prepare_dataset(Dataset.from_dict(rows), build_tokenizer(), max_positions=6)) == 1
