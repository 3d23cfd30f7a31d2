"""A distributed sampler that can start part-way through an epoch, at a position counted in samples.

The global order of an epoch is exactly DistributedSampler's (a permutation seeded with
``seed + epoch``, padded or truncated to a multiple of the world size); rank r reads every
world-size-th index of it from ``start + r``. ``start`` counts samples consumed by *all* ranks,
so a run resumed on a different number of processes continues the same global sample order:
with the same global batch, every optimizer step sees the same samples.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils.data import Sampler

from spikingsail.errors import SailError


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


def split_batch(total: int, weights: Sequence[float]) -> list[int]:
    """Integer shares of ``total`` samples in proportion to ``weights``: each at least 1, summing to
    ``total`` (largest remainders get the leftover samples; ties go to the lower rank). Every rank
    computes the same shares from the same weights."""
    count = len(weights)
    if count == 0 or total < count:
        raise ValueError(f"cannot split {total} sample(s) over {count} rank(s) with at least one each")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"weights must be finite and positive, got {list(weights)}")
    scale = total / math.fsum(weights)
    ideal = [w * scale for w in weights]
    shares = [max(1, math.floor(x)) for x in ideal]
    by_excess = sorted(range(count), key=lambda i: (ideal[i] - shares[i], i))  # most over their ideal first
    while sum(shares) > total:  # the floor of 1 took samples from the others
        i = next(i for i in by_excess if shares[i] > 1)
        shares[i] -= 1
        by_excess = sorted(range(count), key=lambda i: (ideal[i] - shares[i], i))
    for i in sorted(range(count), key=lambda i: (-(ideal[i] - shares[i]), i))[: total - sum(shares)]:
        shares[i] += 1
    return shares


class BalancedBatchSampler(Sampler[list[int]]):
    """This rank's batches when ranks take unequal shares of every global micro-batch.

    The epoch's global order is ``ResumableShardSampler``'s (so DistributedSampler's); it is read in
    consecutive blocks of one global micro-batch (the sum of the shares), and rank r takes the
    r-th slice of each block. A block holds the same samples as with equal shares, whatever the
    split, so a step sees the samples it would on one process. ``shares()`` is asked at the start
    of every block: a new split takes effect at the next block on every rank alike. A last block
    shorter than a global micro-batch is split in the same proportions; it is dropped with
    ``drop_last``, and when it has fewer samples than there are ranks. Each batch's (samples,
    block size), which the loss weighting needs, goes into ``handed`` as the batch is taken (ahead of
    use when DataLoader workers prefetch; the loader takes them out in the same order).
    """

    def __init__(
        self,
        length: int,
        shares: Callable[[], Sequence[int]],
        *,
        rank: int,
        world_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.order = ResumableShardSampler(
            length, rank=rank, world_size=world_size, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self.shares, self.rank, self.drop_last = shares, rank, drop_last
        self.start = 0
        self.handed: deque[tuple[int, int]] = deque()

    def set_epoch(self, epoch: int) -> None:
        self.order.set_epoch(epoch)

    def blocks(self) -> Iterator[tuple[list[int], int]]:
        """(this rank's indices, the block's size) for every block from ``start`` to the epoch's end."""
        order, total, position = self.order.global_order(), self.order.total, self.start
        while position < total:
            shares = list(self.shares())
            block = sum(shares)
            if position + block > total:
                block = total - position
                if self.drop_last or block < len(shares):
                    return
                shares = split_batch(block, shares)
            offset = position + sum(shares[: self.rank])
            yield order[offset : offset + shares[self.rank]], block
            position += block

    def __iter__(self) -> Iterator[list[int]]:
        self.handed.clear()
        for indices, block in self.blocks():
            self.handed.append((len(indices), block))
            yield indices

    def __len__(self) -> int:
        shares = self.shares()
        full, rest = divmod(max(self.order.total - self.start, 0), sum(shares))
        return full + int(not self.drop_last and rest >= len(shares))


class ReplicaBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches when replica groups come and go.

    An epoch's global order is DistributedSampler's permutation (``seed + epoch``), padded by
    repeating its start to whole optimizer steps of ``step_samples`` (micro-batch × ranks of all
    groups × accumulation). Micro-batch m of the epoch's step s is the block at
    ``s × step_samples + m × micro_samples``, split among the ranks taking part (``split``). The
    step is the engine's committed step count, read as each batch is asked for, so a step that
    was not committed is served again and a healed group continues from its peer's position. A
    DataLoader with workers would ask ahead; the engine refuses workers here.
    """

    def __init__(
        self,
        length: int,
        *,
        micro_samples: int,
        accumulation: int,
        split: Callable[[int], tuple[list[int], int | None]],
        progress: Callable[[], tuple[int, int]],
        shuffle: bool,
        seed: int,
    ) -> None:
        self.length, self.micro_samples, self.accumulation = length, micro_samples, accumulation
        self.step_samples = micro_samples * accumulation
        self.steps_per_epoch = max(1, -(-length // self.step_samples))
        self.split, self.progress = split, progress
        self.shuffle, self.seed = shuffle, seed
        self.share: tuple[int, int] | None = None

    def epoch(self) -> int:
        return self.progress()[0] // self.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """The epoch follows the committed steps."""

    def position(self) -> int:
        """The samples of the epoch's global order taken so far — a plain loader's position, so that a
        resume without replica groups continues here."""
        steps, micro = self.progress()
        return (steps % self.steps_per_epoch) * self.step_samples + micro * self.micro_samples

    def order(self, epoch: int) -> list[int]:
        """ResumableShardSampler's global order, padded to whole steps (its world: one step's samples)."""
        steps = ResumableShardSampler(self.length, rank=0, world_size=self.step_samples, shuffle=self.shuffle,
                                      seed=self.seed)  # fmt: skip
        steps.set_epoch(epoch)
        return steps.global_order()

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch()
        order = self.order(epoch)
        while True:
            # the quorum first: a group that heals there continues at the step it healed to
            shares, index = self.split(self.micro_samples)
            steps, micro = self.progress()
            if steps // self.steps_per_epoch != epoch:
                if steps // self.steps_per_epoch > epoch + 1:
                    raise SailError(
                        f"this replica group healed from epoch {epoch} to epoch {steps // self.steps_per_epoch}",
                        "the training script's epoch loop, counting from where this process started, would "
                        "run epochs the job has already done",
                        "nothing to do: the process stops so that its torchrun agent restarts it (keep "
                        "--max-restarts above 0), and a restarted group starts at the job's epoch",
                    )
                return
            start = (steps % self.steps_per_epoch) * self.step_samples + micro * self.micro_samples
            offset = start + sum(shares[: index or 0])
            count = shares[index or 0]
            self.share = (count if index is not None else 0, self.micro_samples)
            yield order[offset : offset + count]

    def __len__(self) -> int:
        return self.steps_per_epoch * self.accumulation
