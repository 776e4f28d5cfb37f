"""Held-out evaluation (``jagg.loop.evaluate``): the rank shards and their padding mask, the EMA swap."""

from __future__ import annotations

import pytest
import torch

from jagg.distributed import DistInfo
from jagg.loop.evaluate import eval_shard, swapped_in


@pytest.mark.parametrize(("n", "world"), [(5, 1), (5, 2), (7, 3), (2, 4), (1, 3)])
def test_shards_cover_every_sample_once_with_equal_lengths(n, world):
    """Every rank gets ceil(n / world) rows; the real ones, in rank order, are 0..n-1 exactly once; padding
    repeats a real sample and is masked out."""
    shards = [eval_shard(n, DistInfo(rank=r, world_size=world)) for r in range(world)]
    per = -(-n // world)
    assert all(len(s.rows) == len(s.real) == (n if world == 1 else per) for s in shards)
    real = [i for s in shards for i, keep in zip(s.rows, s.real) if keep]
    assert real == list(range(n))
    assert all(0 <= i < n for s in shards for i in s.rows)  # padding repeats a real row


def test_padding_of_a_rank_without_real_rows_repeats_the_last_sample():
    shard = eval_shard(2, DistInfo(rank=3, world_size=4))
    assert shard.rows == [1] and shard.real == [False]
    shard = eval_shard(5, DistInfo(rank=1, world_size=2))
    assert shard.rows == [3, 4, 4] and shard.real == [True, True, False]


def test_swapped_in_restores_the_trained_weights():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.zeros(2))]
    ema = [torch.full((3,), 5.0), torch.full((2,), -1.0)]
    with swapped_in(params, ema):
        assert torch.equal(params[0], ema[0]) and torch.equal(params[1], ema[1])
    assert torch.equal(params[0], torch.ones(3)) and torch.equal(params[1], torch.zeros(2))
    with swapped_in(params, None):  # no EMA: nothing changes
        assert torch.equal(params[0], torch.ones(3))
