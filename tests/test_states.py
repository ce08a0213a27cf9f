"""states.py helpers shared by the sampler, the trainers and evaluation."""

import torch

from trl_diffusion.states import left_pad, through_first_stop


def test_through_first_stop_keeps_the_stop_and_cuts_after_it():
    ids = torch.tensor([[5, 0, 6, 0], [5, 6, 7, 8], [0, 5, 6, 7]])
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [0, 1, 1, 1]]).bool()  # the last row's stop is not valid
    kept = through_first_stop(ids, valid, torch.tensor([0, 9]))
    assert kept.long().tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]]


def test_left_pad_puts_every_row_last_token_in_the_last_column():
    ids, mask = left_pad([[7, 8, 9], [4]], pad_id=2)
    assert ids.tolist() == [[7, 8, 9], [2, 2, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ids.dtype == mask.dtype == torch.long
