"""Unequal per-rank micro-batches for ranks of unequal speed (``"sail": {"balance": ...}``).

Every global micro-batch (``train_batch_size / gradient_accumulation_steps`` samples) is split into
per-rank shares: fixed weights, or ``auto``, measured. The data loader hands each rank its slice of
the global order (``BalancedBatchSampler``), so a step sees the samples one process would, and
each rank's loss is weighted by its share (``loss_weight``), so that the average the backends take
over ranks is the mean over the whole global micro-batch: the optimizer step one process would
take, whatever the split.

``auto`` times the forward pass of the model's leaf modules on every rank (CUDA events on a GPU,
the wall clock on a CPU). Leaf modules hold no collective — DDP's buffer broadcast, FSDP's
all-gathers and the gradient all-reduce happen outside them, and synchronised batch norm is left
out — so the time is this rank's compute, not its wait for the others. After a warm-up step it
measures ``MEASURE_STEPS`` optimizer steps, splits in proportion to the ranks' samples per second,
and keeps watching: when a rank's share of the total speed moves by more than
``rebalance_factor`` over the last ``MEASURE_STEPS`` steps, it splits again. Every rank decides from
the same all-reduced numbers, so the split changes at the same step everywhere.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from spikingsail.data.sampler import split_batch

log = logging.getLogger(__name__)

WARMUP_STEPS = 1
MEASURE_STEPS = 3
_SYNCHRONISING = (nn.SyncBatchNorm,)


class ComputeTimer:
    """Time spent inside the forward of a model's leaf modules on this rank, and the samples it saw."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.active = False
        """Only the engine's training forwards count (an evaluation in between does not)."""
        self.seconds = 0.0
        self.samples = 0
        self._events: list[tuple[Any, Any]] = []
        self._started: dict[int, Any] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        for module in model.modules():
            if next(module.children(), None) is not None or _synchronises(module):
                continue
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave))

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return time.perf_counter()

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self.active:
            self._started[id(module)] = self._now()

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        start = self._started.pop(id(module), None)
        if start is None:
            return
        end = self._now()
        if self.cuda:
            self._events.append((start, end))
        else:
            self.seconds += end - start

    def take(self) -> tuple[float, int]:
        """(seconds, samples) since the last ``take``."""
        if self._events:
            self._events[-1][1].synchronize()
            self.seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
            self._events.clear()
        out = (self.seconds, self.samples)
        self.seconds, self.samples = 0.0, 0
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _synchronises(module: nn.Module) -> bool:
    return isinstance(module, _SYNCHRONISING) or type(module).__name__ == "MultiStepSyncBatchNorm"


class Balancer:
    """The current split of the global micro-batch, and for ``auto`` the measurement that sets it."""

    def __init__(
        self,
        *,
        global_micro_batch: int,
        world_size: int,
        weights: Sequence[float] | None,
        rebalance_factor: float,
    ) -> None:
        """``weights`` None: ``auto`` (equal shares until measured)."""
        self.global_micro_batch = global_micro_batch
        self.world_size = world_size
        self.auto = weights is None
        self.rebalance_factor = rebalance_factor
        self.weights: list[float] = list(weights) if weights is not None else [1.0] * world_size
        self.split = split_batch(global_micro_batch, self.weights)
        self.timer: ComputeTimer | None = None
        self._steps = 0
        self._window: deque[list[float]] = deque(maxlen=MEASURE_STEPS)
        self._reference: list[float] | None = None  # the speed fractions the split was made from
        self.changes: list[dict[str, Any]] = []
        """Every change of split, for the monitor: step, speeds (samples/s), split."""

    def shares(self) -> list[int]:
        return self.split

    def loss_weight(self, own: int, block: int) -> float:
        """What a rank's mean loss over ``own`` samples is multiplied by so that the average over
        ranks is the mean over the ``block`` samples of the global micro-batch."""
        return self.world_size * own / block

    def attach(self, model: nn.Module, device: torch.device) -> None:
        if self.auto and self.timer is None:
            self.timer = ComputeTimer(model, device)

    @contextlib.contextmanager
    def measuring(self, samples: int) -> Iterator[None]:
        """Around a training forward of ``samples`` samples of this rank's share."""
        if self.timer is None:
            yield
            return
        self.timer.samples += samples
        self.timer.active = True
        try:
            yield
        finally:
            self.timer.active = False

    def after_step(
        self, step: int, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], rank: int
    ) -> dict[str, Any] | None:
        """At an optimizer-step boundary, on every rank alike: measure, and split again when due.
        Returns the change (step, speeds, split) when the split changed."""
        if self.timer is None:
            return None
        seconds, samples = self.timer.take()
        self._steps += 1
        if self._steps <= WARMUP_STEPS:
            return None
        mine = torch.zeros(self.world_size, 2, dtype=torch.float64)
        mine[rank] = torch.tensor([seconds, samples], dtype=torch.float64)
        both = all_reduce_sum(mine)
        speeds = [float(n) / max(float(s), 1e-12) for s, n in both.tolist()]
        self._window.append(speeds)
        if len(self._window) < MEASURE_STEPS:
            return None
        speeds = [statistics.median(column) for column in zip(*self._window, strict=True)]
        fractions = [s / math.fsum(speeds) for s in speeds]
        if self._reference is not None and not self._moved(fractions):
            return None
        self._reference = fractions
        self._window.clear()
        split = split_batch(self.global_micro_batch, speeds)
        if split == self.split:
            return None
        self.split, self.weights = split, speeds
        change = {"step": step, "speeds": [round(s, 3) for s in speeds], "split": split}
        self.changes.append(change)
        if rank == 0:
            log.info("balance at step %d: samples/s per rank %s -> micro-batches %s", step,
                     ", ".join(f"{s:.1f}" for s in speeds), split)  # fmt: skip
        return change

    def _moved(self, fractions: list[float]) -> bool:
        assert self._reference is not None
        limit = math.log(self.rebalance_factor)
        return any(abs(math.log(f / r)) > limit for f, r in zip(fractions, self._reference, strict=True))

    def state_dict(self) -> dict[str, Any]:
        return {"split": list(self.split), "weights": list(self.weights), "reference": self._reference}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue with the saved split when it fits this job (same global micro-batch and world size)."""
        split = [int(n) for n in state["split"]]
        if (
            len(split) == self.world_size
            and sum(split) == self.global_micro_batch
            and not self._fixed_weights()
        ):
            self.split = split
            self.weights = [float(w) for w in state["weights"]]
            self._reference = state["reference"]

    def _fixed_weights(self) -> bool:
        return not self.auto
