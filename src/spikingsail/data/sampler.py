"""Distributed samplers that can start part-way through an epoch, at a position counted in samples.

The global order of an epoch is exactly DistributedSampler's (a permutation seeded with
``seed + epoch``, padded or truncated to a multiple of the world size); rank r reads every
world-size-th index of it from ``start + r``. ``start`` counts samples consumed by *all* ranks,
so a run resumed on a different number of processes continues the same global sample order:
with the same global batch, every optimizer step sees the same samples. An epoch that is not a
whole number of optimizer steps is read step by step instead (``StepBatchSampler``, unpadded), so
that its short last step is the same samples on every split too.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils.data import Sampler

from spikingsail.errors import ConfigError, SailError


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


class StepBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches, read from the epoch's global order one optimizer step at a time.

    The engine's training loader when ranks take unequal shares (``shares``, ``sail.balance``) or an
    epoch is not a whole number of optimizer steps. The global order is the epoch's permutation
    (``seed + epoch``, as DistributedSampler's), unpadded. It is read in optimizer steps of
    ``micro_samples × accumulation`` samples, each step in ``accumulation`` blocks of one global
    micro-batch, and every rank takes its part of every block: every ``world_size``-th sample from its
    rank on (as DistributedSampler deals them), or with ``shares`` the rank-th slice of the shares
    asked for at the block (a new split takes effect at the next block on every rank alike).

    The epoch's last ``length % step`` samples are a short step, whatever the split: the same
    samples, in ``accumulation`` blocks of sizes as equal as can be, each dealt like a whole one (in
    proportion to the shares), so that with each batch's loss weighted by its rank's samples over
    the step's (``loss_weight``) the short step's gradient is the mean over its samples, as one
    process taking it in one batch computes it. ``drop_last`` drops it. A short step with fewer
    samples than it has micro-batches over all ranks cannot give each one a sample: refused.
    Each batch's (samples, block size, step size) goes into ``handed`` as the batch is taken (ahead
    of use when DataLoader workers prefetch; the loader takes them out in the same order).
    """

    def __init__(
        self,
        length: int,
        *,
        rank: int,
        world_size: int,
        micro_samples: int,
        accumulation: int = 1,
        shares: Callable[[], Sequence[int]] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        """``micro_samples``: one global micro-batch (the sum of the shares when ``shares`` is given)."""
        self.order = ResumableShardSampler(length, rank=0, world_size=1, shuffle=shuffle, seed=seed)
        self.rank, self.world_size, self.shares = rank, world_size, shares
        self.micro_samples, self.accumulation = micro_samples, accumulation
        self.step = micro_samples * accumulation
        whole, rest = divmod(length, self.step)
        self.whole = whole * self.step
        """Where the short step begins: the samples of the epoch's whole steps."""
        self.short = [] if drop_last or not rest else self._short_blocks(length, rest)
        """The short step's block sizes (none when it is dropped or there is none)."""
        self.start = 0
        self.handed: deque[tuple[int, int, int]] = deque()

    def _short_blocks(self, length: int, rest: int) -> list[int]:
        slots = self.accumulation * self.world_size
        if rest < slots:
            raise ConfigError(
                f"the last optimizer step of every epoch has {rest} sample(s) ({length} samples, "
                f"{self.step} per step), fewer than its {self.accumulation} micro-step(s) × "
                f"{self.world_size} process(es)",
                "every process needs a sample in every micro-step; with fewer, the epoch's short step "
                "cannot train on the same samples with the same weights as on any other split",
                f"pass drop_last=True to engine.dataloader (every split then drops those {rest} sample(s) alike), "
                f"make the dataset's length a multiple of {self.step}, or leave at least {slots} "
                "samples over (fewer processes or micro-steps per step)",
            )
        return split_batch(rest, [1.0] * self.accumulation)

    def set_epoch(self, epoch: int) -> None:
        self.order.set_epoch(epoch)

    @property
    def total(self) -> int:
        """The samples of an epoch: its whole steps and the short step, unless dropped."""
        return self.whole + sum(self.short)

    def _block_sizes(self) -> Iterator[tuple[int, int]]:
        """(block size, step size) of every block from ``start`` to the epoch's end."""
        position = self.start
        while position < self.whole:
            yield self.micro_samples, self.step
            position += self.micro_samples
        offset = self.whole
        for block in self.short:
            if offset >= position:
                yield block, sum(self.short)
            elif offset + block > position:
                raise ConfigError(
                    f"the data position {self.start} falls inside a micro-batch of the epoch's short "
                    "step as this run splits it",
                    "a checkpoint saved inside an accumulation window resumes with the same split only",
                    "resume with the processes, micro-batch and accumulation that saved it",
                )
            offset += block

    def _mine(self, order: list[int], position: int, block: int) -> list[int]:
        if self.shares is None:
            return order[position + self.rank : position + block : self.world_size]
        shares = list(self.shares())
        if block != sum(shares):
            shares = split_batch(block, shares)
        offset = position + sum(shares[: self.rank])
        return order[offset : offset + shares[self.rank]]

    def __iter__(self) -> Iterator[list[int]]:
        self.handed.clear()
        order, position = self.order.global_order(), self.start
        for block, step in self._block_sizes():
            indices = self._mine(order, position, block)
            self.handed.append((len(indices), block, step))
            yield indices
            position += block

    def __len__(self) -> int:
        whole = max(0, -(-(self.whole - self.start) // self.micro_samples))
        offsets = itertools.accumulate(self.short, initial=self.whole)
        return whole + sum(1 for offset in list(offsets)[:-1] if offset >= self.start)


class ReplicaBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches when replica groups come and go.

    An epoch's global order is DistributedSampler's permutation (``seed + epoch``), read in
    optimizer steps of ``step_samples`` (micro-batch × ranks of all groups × accumulation) as
    ``StepBatchSampler`` reads it: micro-batch m of the epoch's step s is the block at
    ``s × step_samples + m × micro_samples``, split among the ranks taking part (``split``), and the
    epoch's last ``length % step_samples`` samples are a short step of ``accumulation`` blocks as
    equal as can be (dropped with ``drop_last``). The step is the engine's committed step count,
    read as each batch is asked for, so a step that was not committed is served again and a healed
    group continues from its peer's position. A DataLoader with workers would ask ahead; the engine
    refuses workers here.
    """

    def __init__(
        self,
        length: int,
        *,
        micro_samples: int,
        accumulation: int,
        ranks: int,
        split: Callable[[int], tuple[list[int], int | None]],
        progress: Callable[[], tuple[int, int]],
        shuffle: bool,
        seed: int,
        drop_last: bool = False,
    ) -> None:
        """``ranks``: the processes of all groups (a short step gives each a sample of every block)."""
        self.length, self.micro_samples, self.accumulation = length, micro_samples, accumulation
        self.step_samples = micro_samples * accumulation
        steps = StepBatchSampler(length, rank=0, world_size=ranks, micro_samples=micro_samples,
                                 accumulation=accumulation, drop_last=drop_last)  # fmt: skip
        self.whole_steps, self.short = steps.whole // self.step_samples, steps.short
        self.steps_per_epoch = max(1, self.whole_steps + bool(self.short))
        self.split, self.progress = split, progress
        self.shuffle, self.seed = shuffle, seed
        self.share: tuple[int, int] | None = None
        """(this rank's samples, the optimizer step's over all ranks) of the batch last handed out."""

    @property
    def total(self) -> int:
        """The samples of an epoch: its whole steps and the short step, unless dropped."""
        return self.whole_steps * self.step_samples + sum(self.short)

    def epoch(self) -> int:
        return self.progress()[0] // self.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """The epoch follows the committed steps."""

    def _block(self, step: int, micro: int) -> tuple[int, int, int]:
        """(start, size, step size) of micro-batch ``micro`` of the epoch's step ``step``."""
        if step < self.whole_steps:
            return (
                step * self.step_samples + micro * self.micro_samples,
                self.micro_samples,
                self.step_samples,
            )
        start = self.whole_steps * self.step_samples + sum(self.short[:micro])
        return start, self.short[micro], sum(self.short)

    def position(self) -> int:
        """The samples of the epoch's global order taken so far — a plain loader's position, so that a
        resume without replica groups continues here."""
        steps, micro = self.progress()
        return self._block(steps % self.steps_per_epoch, micro)[0]

    def order(self, epoch: int) -> list[int]:
        """ResumableShardSampler's global order on one process (unpadded)."""
        order = ResumableShardSampler(self.length, rank=0, world_size=1, shuffle=self.shuffle, seed=self.seed)
        order.set_epoch(epoch)
        return order.global_order()

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
            start, block, step = self._block(steps % self.steps_per_epoch, micro)
            if block != self.micro_samples:  # a block of the short step, split alike
                shares = split_batch(block, [1.0] * len(shares))
            offset = start + sum(shares[: index or 0])
            count = shares[index or 0]
            self.share = (count if index is not None else 0, step)
            yield order[offset : offset + count]

    def __len__(self) -> int:
        return self.whole_steps * self.accumulation + len(self.short)
