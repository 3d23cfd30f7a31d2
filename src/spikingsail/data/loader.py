"""Per-rank data loading: each rank reads its own shard, and the shuffle changes every epoch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler


class ShardedLoader:
    """A DataLoader over this rank's shard that advances the sampler's epoch by itself.

    Iterating it once is one epoch; the next iteration reshuffles with a new epoch number,
    identically on every rank, so nobody has to remember ``sampler.set_epoch``.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        shuffle: bool = True,
        drop_last: bool = False,
        pad: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **loader_kwargs: Any,
    ) -> None:
        self.sampler: DistributedSampler[Any] | ExactShardSampler = (
            DistributedSampler(
                dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
            )
            if pad
            else ExactShardSampler(len(dataset), rank=rank, world_size=world_size)  # type: ignore[arg-type]
        )
        self.loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            drop_last=drop_last,
            num_workers=num_workers,
            pin_memory=pin_memory,
            collate_fn=collate_fn,
            **loader_kwargs,
        )
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        yield from self.loader
        self.epoch += 1

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self) -> Dataset[Any]:
        return self.loader.dataset


class ExactShardSampler(Sampler[int]):
    """Every sample exactly once across ranks, in order (ranks may get one sample more or less).

    DistributedSampler repeats samples so that every rank gets the same count, which is right
    for training but counts some samples twice in an evaluation.
    """

    def __init__(self, length: int, *, rank: int, world_size: int) -> None:
        self.indices = range(rank, length, world_size)

    def set_epoch(self, epoch: int) -> None:
        """Order does not change between epochs."""

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
