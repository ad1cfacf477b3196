"""The rows of one pass of the trainable unit: their seeded order, a DDP rank's share of them,
and the batches they are gathered in.

A pass's row order is a function of (seed, epoch, pass index) alone, so a configuration trains on
the same batches wherever it trains and however often it was stopped (``training/trainable/unit.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def pass_order(seed: int, epoch: int, pass_index: int, n_rows: int) -> Any:
    """The row order of one pass (a permutation of ``n_rows``), from (seed, epoch, pass) alone."""
    import torch

    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch * 1009 + pass_index)
    return torch.randperm(n_rows, generator=generator)


class Batches:
    """The batches of one pass: rows of ``tensors`` in ``order``, ``batch_size`` at a time,
    gathered by index (one gather per tensor and batch, on whatever device the tensors are)."""

    def __init__(self, tensors: Sequence[Any], order: Any, batch_size: int) -> None:
        self.tensors, self.batch_size = list(tensors), batch_size
        self.order = order.to(self.tensors[0].device) if len(order) else order

    def __len__(self) -> int:
        return -(-len(self.order) // self.batch_size)

    def __iter__(self) -> Any:
        for start in range(0, len(self.order), self.batch_size):
            index = self.order[start : start + self.batch_size]
            yield [t[index] for t in self.tensors]


def rank_share(order: Any, rank: int, world: int) -> Any:
    """Rank ``rank``'s rows of ``order`` among ``world`` ranks: padded from its start to a
    multiple of ``world``, then every ``world``-th row (each rank takes as many steps)."""
    if world <= 1:
        return order
    import torch

    padding = (-len(order)) % world
    padded = torch.cat([order, order[:padding]]) if padding else order
    return padded[rank::world]
