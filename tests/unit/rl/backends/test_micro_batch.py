"""The micro-batch planner (`rl.backends.micro_batch`): micro-batches by rows and padded tokens, and their limits per
device."""

import pytest
import torch

from rl.backends.micro_batch import micro_batch_limits, micro_batch_slices
from rl.config import config_from_dict


def _spans(slices):
    return [(s.start, s.stop) for s in slices]


def test_micro_batches_are_consecutive_rows_under_a_row_cap_and_a_padded_token_budget():
    lengths = torch.tensor([5, 3, 8, 2, 2, 9, 1])
    assert _spans(micro_batch_slices(lengths, max_rows=3, max_tokens=None)) == [(0, 3), (3, 6), (6, 7)]
    assert _spans(micro_batch_slices(lengths, max_rows=None, max_tokens=None)) == [(0, 7)]
    # padded tokens = rows x longest: [5, 3] -> 10; + 8 would be 24 > 16; [8, 2] -> 16; [2, 9] -> 18 > 16, so 2 alone...
    assert _spans(micro_batch_slices(lengths, max_rows=None, max_tokens=16)) == [(0, 2), (2, 4), (4, 5), (5, 6), (6, 7)]
    assert _spans(micro_batch_slices(lengths, max_rows=1, max_tokens=100)) == [(i, i + 1) for i in range(7)]
    assert _spans(micro_batch_slices(torch.tensor([20, 4]), max_rows=None, max_tokens=10)) == [
        (0, 1),
        (1, 2),
    ]  # too long: alone
    assert micro_batch_slices(torch.zeros(0, dtype=torch.int64), max_rows=4, max_tokens=8) == []
    for cap, budget in ((2, 12), (None, 9), (4, None)):  # invariants: cover 0..n in order, within the limits or one row
        got = micro_batch_slices(lengths, max_rows=cap, max_tokens=budget)
        assert [i for s in got for i in range(s.start, s.stop)] == list(range(7))
        for s in got:
            rows = s.stop - s.start
            assert rows == 1 or (
                (cap is None or rows <= cap) and (budget is None or rows * int(lengths[s].max()) <= budget)
            )


def test_null_limits_resolve_from_the_device_and_set_ones_win():
    from transformers import LlamaConfig

    shape = LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    cfg = config_from_dict({})
    assert micro_batch_limits(cfg, shape, "cpu", train=True) == (32, None)  # the CPU default: 32 rows, no budget
    assert micro_batch_limits(cfg, shape, "cpu", train=False) == (32, None)
    set_ = config_from_dict(
        {
            "optim": {
                "train_micro_batch_size": 4,
                "train_max_tokens_per_micro_batch": 512,
                "logprob_max_tokens_per_micro_batch": 64,
            }
        }
    )
    assert micro_batch_limits(set_, shape, "cpu", train=True) == (4, 512)
    assert micro_batch_limits(set_, shape, "cpu", train=False) == (None, 64)  # a budget alone: no row cap
    with pytest.raises(ValueError, match=r"optim.train_max_tokens_per_micro_batch.*is 0.*>= 1, or null"):
        config_from_dict({"optim": {"train_max_tokens_per_micro_batch": 0}})
