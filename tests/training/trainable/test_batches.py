"""The rows of a pass: a seeded order, a DDP rank's share of it, and its batches."""

from __future__ import annotations

import torch

from mopflow.training.trainable.batches import Batches, pass_order, rank_share


def test_pass_order_is_a_function_of_seed_epoch_and_pass_alone() -> None:
    first = pass_order(3, 1, 0, 50)
    assert sorted(first.tolist()) == list(range(50))
    assert torch.equal(first, pass_order(3, 1, 0, 50))
    assert not torch.equal(first, pass_order(3, 2, 0, 50))
    assert not torch.equal(first, pass_order(3, 1, 1, 50))
    assert not torch.equal(first, pass_order(4, 1, 0, 50))


def test_rank_shares_are_equal_and_cover_the_order_padded_from_its_start() -> None:
    order = torch.arange(7)
    shares = [rank_share(order, rank, 3) for rank in range(3)]
    assert [len(s) for s in shares] == [3, 3, 3]  # 7 rows padded to 9: every rank takes 3 steps
    assert sorted(torch.cat(shares).tolist()) == sorted([*range(7), 0, 1])
    assert rank_share(order, 0, 1) is order  # one rank: the whole order


def test_batches_gather_the_rows_in_order() -> None:
    x, y = torch.arange(10) * 10, torch.arange(10)
    batches = Batches([x, y], torch.tensor([4, 2, 0, 9, 1]), batch_size=2)
    assert len(batches) == 3
    assert [b[1].tolist() for b in batches] == [[4, 2], [0, 9], [1]]
    assert [b[0].tolist() for b in batches][0] == [40, 20]
