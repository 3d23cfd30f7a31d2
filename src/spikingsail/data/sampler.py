"""A distributed sampler that can start part-way through an epoch, at a position counted in samples.

The global order of an epoch is exactly DistributedSampler's (a permutation seeded with
``seed + epoch``, padded or truncated to a multiple of the world size); rank r reads every
world-size-th index of it from ``start + r``. ``start`` counts samples consumed by *all* ranks,
so a run resumed on a different number of processes continues the same global sample order:
with the same global batch, every optimizer step sees the same samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableShardSampler(Sampler[int]):
    def __init__(
        self,
        length: int,
        *,
        rank: int,
        world_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.length, self.rank, self.world_size = length, rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.start = 0
        if drop_last and length % world_size:
            per_rank = math.ceil((length - world_size) / world_size)
        else:
            per_rank = math.ceil(length / world_size)
        self.total = per_rank * world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def global_order(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.length, generator=generator).tolist()
        else:
            indices = list(range(self.length))
        if self.total <= len(indices):
            return indices[: self.total]
        padding = self.total - len(indices)
        return indices + (indices * math.ceil(padding / len(indices)))[:padding]

    def __iter__(self) -> Iterator[int]:
        return iter(self.global_order()[self.start + self.rank : self.total : self.world_size])

    def __len__(self) -> int:
        return len(range(self.start + self.rank, self.total, self.world_size))
