"""Per-rank data loading: each rank reads its own shard, the shuffle changes every epoch, and the
position in the epoch is kept (in samples, over all ranks) so that a checkpoint can resume it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler

from spikingsail.data.sampler import ReplicaBatchSampler, ResumableShardSampler, StepBatchSampler
from spikingsail.tensors import map_tensors


class ShardedLoader:
    """A DataLoader over this rank's shard that advances the sampler's epoch by itself.

    Iterating it once is one epoch; the next iteration reshuffles with a new epoch number,
    identically on every rank, so nobody has to remember ``sampler.set_epoch``. ``position`` counts
    the samples all ranks have taken in the current epoch; ``state_dict`` / ``load_state_dict``
    carry ``epoch`` and ``position`` through a checkpoint, so the next batch after a resume is the
    one that would have come next.
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
        on_batch: Callable[[], None] | None = None,
        device: torch.device | None = None,
        shares: Callable[[], Sequence[int]] | None = None,
        accumulation: int | None = None,
        replicated: ReplicaBatchSampler | None = None,
        record: Callable[[list[int], int], None] | None = None,
        **loader_kwargs: Any,
    ) -> None:
        """``on_batch`` runs before each batch is handed out (the engine resets spiking neurons there).
        ``device``: every tensor of a batch (inputs and labels alike, in any nesting of lists,
        tuples and dicts) is moved there before it is handed out, as Accelerate's and Fabric's
        loaders do; None leaves batches where the dataset made them. ``shares``: unequal per-rank
        micro-batches (``StepBatchSampler``), asked for the current split at every global
        micro-batch; ``batch_size`` is then unused. ``accumulation``: the engine's training loader,
        whose epoch is read in optimizer steps of ``batch_size × world_size × accumulation``
        samples (the same per step on any split, also the epoch's short last one). With either,
        ``share`` tells each batch's part of its optimizer step. ``replicated``: batches of replica groups (``ReplicaBatchSampler``),
        whose epoch and position follow the engine's committed steps. ``record``: called with the
        dataset indices of each batch as it is handed out, and the epoch, when the batch counts in
        its step (a replica group's batch that takes no part does not): the sample ledger's."""
        self.on_batch = on_batch
        self.device = device
        length = len(dataset)  # type: ignore[arg-type]
        self.sampler: ResumableShardSampler | ExactShardSampler | StepBatchSampler | ReplicaBatchSampler
        ragged = pad and accumulation is not None and length % (batch_size * world_size * accumulation)
        if replicated is not None:
            self.sampler = replicated
        elif shares is not None or ragged:
            # an epoch of whole steps without shares keeps the plain sampler: the same batches, and
            # no share to weigh the losses by (every loss weighs 1)
            self.sampler = StepBatchSampler(
                length, rank=rank, world_size=world_size, shares=shares, accumulation=accumulation or 1,
                micro_samples=sum(shares()) if shares is not None else batch_size * world_size,
                shuffle=shuffle, seed=seed, drop_last=drop_last,
            )  # fmt: skip
        elif pad:
            self.sampler = ResumableShardSampler(
                length, rank=rank, world_size=world_size, shuffle=shuffle, seed=seed, drop_last=drop_last
            )
        else:
            self.sampler = ExactShardSampler(length, rank=rank, world_size=world_size)
        self.share: tuple[int, int] | None = None
        """With a ``StepBatchSampler``: (this rank's samples, its optimizer step's over all ranks) of the
        batch last handed out; with ``replicated``: (this rank's samples, the global micro-batch's)."""
        self.batch_size = batch_size
        self.world_size = world_size
        self.position = 0
        self.seed = seed
        # A DataLoader draws its workers' base seed from the global torch RNG each time it is
        # iterated; an iterator made at a resume would then shift the model's random stream
        # (dropout). A generator of the loader's own keeps the global stream untouched.
        self._own_generator = "generator" not in loader_kwargs
        self._generator = loader_kwargs.pop("generator", None) or torch.Generator()
        batching: dict[str, Any] = (
            {"batch_sampler": self.sampler}
            if isinstance(self.sampler, StepBatchSampler | ReplicaBatchSampler)
            else {"batch_size": batch_size, "sampler": self.sampler, "drop_last": drop_last}
        )
        self._record = record
        self._taken: deque[list[int]] = deque()
        """With ``record``: the indices of each batch the sampler gave, in order (workers take them ahead)."""
        if record is not None:
            inner = batching.get("batch_sampler") or BatchSampler(
                cast(Sampler[int], self.sampler), batch_size, drop_last
            )
            batching = {"batch_sampler": _Taken(inner, self._taken)}
        self.loader: DataLoader[Any] = DataLoader(
            dataset,
            **batching,
            num_workers=num_workers,
            pin_memory=pin_memory,
            collate_fn=collate_fn,
            generator=self._generator,
            **loader_kwargs,
        )
        self.epoch = replicated.epoch() if replicated is not None else 0
        self._active: object | None = None  # the pass under way

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch`` (as ``DistributedSampler.set_epoch`` does). The epoch
        the loader is in already keeps its position: the usual ``loader.set_epoch(epoch)`` at the top
        of a resumed epoch loop continues where the checkpoint left the epoch, not at its start."""
        self._active = None
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0

    def __iter__(self) -> Iterator[Any]:
        if isinstance(self.sampler, ReplicaBatchSampler):
            yield from self._replicated(self.sampler)
            return
        if self._active is not None:
            # The previous pass was left before its end (break): this one is the next epoch, with a
            # new shuffle, as with a DataLoader and set_epoch. Its state stayed where it was left
            # until now, so a checkpoint saved after the break continues that epoch on resume.
            self._end_epoch()
        token = self._active = object()
        self.sampler.set_epoch(self.epoch)
        if self._own_generator:
            self._generator.manual_seed(self.seed * 1_000_003 + self.epoch)
        if isinstance(self.sampler, ResumableShardSampler | StepBatchSampler):
            self.sampler.start = self.position
        taken = self.batch_size * self.world_size  # the global micro-batch's samples
        self._taken.clear()
        for batch in self.loader:
            if self._active is not token:
                return  # a newer pass (or a load) took over from this one
            if isinstance(self.sampler, StepBatchSampler):
                own, taken, step = self.sampler.handed.popleft()
                self.share = (own, step)
            if self._record is not None:
                self._record(self._taken.popleft(), self.epoch)
            self.position += taken
            if self.on_batch is not None:
                self.on_batch()
            yield batch if self.device is None else map_tensors(batch, self._to_device)
        if self._active is token:
            self._end_epoch()

    def _replicated(self, sampler: ReplicaBatchSampler) -> Iterator[Any]:
        """One epoch of replica-group batches: the epoch and the position are the engine's."""
        self.epoch = sampler.epoch()
        if self._own_generator:
            self._generator.manual_seed(self.seed * 1_000_003 + self.epoch)
        self._taken.clear()
        for batch in self.loader:
            self.share = sampler.share
            if self._record is not None:
                ids = self._taken.popleft()
                if self.share is not None and self.share[0]:  # a healing group's batch counts nowhere
                    self._record(ids, self.epoch)
            if self.on_batch is not None:
                self.on_batch()
            yield batch if self.device is None else map_tensors(batch, self._to_device)
        self.epoch = sampler.epoch()

    @property
    def weighs_losses(self) -> bool:
        """Whether each batch's loss is to be weighted by its ``share`` (``loss_weight``): with unequal
        shares, or in an epoch that ends with a short step."""
        return isinstance(self.sampler, StepBatchSampler)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=True)

    def _end_epoch(self) -> None:
        self._active = None
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        if isinstance(self.sampler, ReplicaBatchSampler):
            return {"epoch": self.sampler.epoch(), "position": self.sampler.position()}
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at ``state``: the next pass starts there, even one begun before the load.
        Replica-group batches follow the engine's committed steps instead, loaded with them."""
        self._active = None
        if isinstance(self.sampler, ReplicaBatchSampler):
            self.epoch = self.sampler.epoch()
            return
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])

    def __len__(self) -> int:
        return len(self.loader)

    def epoch_samples(self) -> int:
        """The samples a whole epoch of the training loader trains on, over all ranks (fewer than the
        dataset's with ``drop_last`` and an epoch that is not a whole number of steps)."""
        if isinstance(self.sampler, ReplicaBatchSampler | StepBatchSampler | ResumableShardSampler):
            return self.sampler.total
        return len(self.dataset)  # type: ignore[arg-type]

    @property
    def dataset(self) -> Dataset[Any]:
        return self.loader.dataset


class _Taken(Sampler[list[int]]):
    """A batch sampler that notes each batch of indices it gives (``ShardedLoader``'s ``record``)."""

    def __init__(self, inner: Iterable[list[int]], taken: deque[list[int]]) -> None:
        self.inner, self.taken = inner, taken

    def __iter__(self) -> Iterator[list[int]]:
        for indices in self.inner:
            self.taken.append(list(indices))
            yield indices

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


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
