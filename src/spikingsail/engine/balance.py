"""Unequal per-rank micro-batches for ranks of unequal speed (``"sail": {"balance": ...}``).

Every global micro-batch (``train_batch_size / gradient_accumulation_steps`` samples) is split into
per-rank shares: fixed weights, or ``auto``, measured. The data loader hands each rank its slice of
the global order (``BalancedBatchSampler``), so a step sees the samples one process would, and
each rank's loss is weighted by its share (``loss_weight``), so that the average the backends take
over ranks is the mean over the whole global micro-batch: the optimizer step one process would
take, whatever the split.

``auto`` measures each rank's compute time per optimizer step: the step's time less the time the
rank waited for the others at the end of backward (``ComputeTimer``), so that a fast rank's wait
for a slow one does not count as work. After a warm-up step it measures ``MEASURE_STEPS`` optimizer
steps, splits in proportion to the ranks' samples per second of compute over those steps, and
keeps watching: when a rank's share of the total speed moves by more than
``rebalance_factor`` over the last ``MEASURE_STEPS`` steps, it splits again. In the
``REFINE_WINDOWS`` windows after a change it also takes the split the new window's speeds give when,
at the split in use, the slowest rank's compute took more than ``REFINE_TOLERANCE`` longer than an
even split's would: a rank's speed per sample, measured at one share, need not hold at another,
and the split converges on even times. At any later step it splits again when the slowest rank's
compute over the last ``MEASURE_STEPS`` steps took more than ``DRIFT_TOLERANCE`` longer than even
(a slow drift of a rank's speed, below the factor).
Every rank decides from the same all-reduced numbers, so the split changes at the same step
everywhere. Backends whose ranks also wait for each other inside forward and backward (FSDP's
all-gathers) would hide the difference there; they take fixed weights only.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from spikingsail.data.sampler import split_batch
from spikingsail.engine.timing import Clock, LastGradient

log = logging.getLogger(__name__)

WARMUP_STEPS = 1
MEASURE_STEPS = 8
REFINE_WINDOWS = 2
"""Measurement windows after a change of split in which a better-even split is taken (``_uneven``)."""
REFINE_TOLERANCE = 0.02
"""How much longer than an even split's the slowest rank's compute time may be before a refinement
window splits again (a fraction of the even time)."""
DRIFT_TOLERANCE = 0.10
"""The same, at any later step (over the last ``MEASURE_STEPS`` steps): a rank whose speed drifts
by less than ``rebalance_factor`` but costs the step more than this is followed too. Wider than
``REFINE_TOLERANCE`` so that measurement noise does not move the split back and forth."""


class ComputeTimer:
    """This rank's compute time between two optimizer steps: the step's time less the time it
    waited for the other ranks at the end of backward (where DDP and Horovod finish their
    all-reduce), and the samples it trained on.

    The wait is what backward takes after this rank's last gradient (``LastGradient``). Time spent
    in the engine's own collective at the step boundary is outside the window too.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.clock = Clock(device.type == "cuda")
        self.samples = 0
        self.last_gradient = LastGradient(model, self.clock)
        self._waits: list[tuple[Any, Any]] = []
        self._start = self.clock.mark()

    def begin_backward(self) -> None:
        self.last_gradient.begin()

    def end_backward(self) -> None:
        last = self.last_gradient.end()
        if last is not None:
            self._waits.append((last, self.clock.mark()))

    def take(self) -> tuple[float, int]:
        """(compute seconds, samples) since the last ``restart``."""
        step = self.clock.seconds(self._start, self.clock.mark())
        waited = sum(self.clock.seconds(a, b) for a, b in self._waits)
        out = (max(step - waited, 1e-9), self.samples)
        self._waits.clear()
        self.samples = 0
        return out

    def restart(self) -> None:
        self._start = self.clock.mark()

    def remove(self) -> None:
        self.last_gradient.remove()


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
        self.split = split_batch(
            global_micro_batch, list(weights) if weights is not None else [1.0] * world_size
        )
        self.timer: ComputeTimer | None = None
        self._steps = 0
        self._window: deque[torch.Tensor] = deque(
            maxlen=MEASURE_STEPS
        )  # per step: [rank, (seconds, samples)]
        self._reference: list[float] | None = None  # the speed fractions the split was made from
        self._refines = 0
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

    def count(self, samples: int) -> None:
        """A training forward of ``samples`` samples of this rank's share."""
        if self.timer is not None:
            self.timer.samples += samples

    @contextlib.contextmanager
    def timing_backward(self) -> Iterator[None]:
        if self.timer is None:
            yield
            return
        self.timer.begin_backward()
        try:
            yield
        finally:
            self.timer.end_backward()

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
            self.timer.restart()
            return None
        mine = torch.zeros(self.world_size, 2, dtype=torch.float64)
        mine[rank] = torch.tensor([seconds, samples], dtype=torch.float64)
        both = all_reduce_sum(mine)
        self.timer.restart()  # after the collective: its wait for the slowest rank is not compute
        self._window.append(both)
        if len(self._window) < MEASURE_STEPS:
            return None
        # throughput over the whole window: a rank that stalls now and then (a throttled or shared
        # device) is as slow as its stalls make it, which a median of steps would hide
        totals = torch.stack(list(self._window)).sum(0).tolist()
        speeds = [float(n) / max(float(t), 1e-12) for t, n in totals]
        fractions = [s / math.fsum(speeds) for s in speeds]
        split = split_batch(self.global_micro_batch, speeds)
        refined = False
        if self._reference is not None and not self._moved(fractions):
            # no rank's speed moved by the factor. Shortly after a change, take a split that evens
            # the ranks' times better, measured at the split now in use (a rank's speed per sample
            # need not be the same at another share); later, one that corrects a slow drift.
            if self._refines:
                if not self._uneven(speeds, REFINE_TOLERANCE):
                    self._refines = 0
                    return None
                self._refines -= 1
            elif self._uneven(speeds, DRIFT_TOLERANCE):
                self._refines = REFINE_WINDOWS  # measured at the old shares: refined as after a change
            else:
                return None
            refined = True
        else:
            self._refines = REFINE_WINDOWS
        self._reference = fractions
        self._window.clear()
        if split == self.split:
            return None
        self.split = split
        change = {"step": step, "speeds": [round(s, 3) for s in speeds], "split": split, "refined": refined}
        self.changes.append(change)
        if rank == 0:
            log.info("balance at step %d%s: samples/s per rank %s -> micro-batches %s", step,
                     " (refined)" if refined else "", ", ".join(f"{s:.1f}" for s in speeds), split)  # fmt: skip
        return change

    def _uneven(self, speeds: list[float], tolerance: float) -> bool:
        """Whether, at the split in use and the ``speeds`` (samples/s) measured at it, the slowest
        rank's compute took more than ``tolerance`` longer than an even split's would. A criterion
        in time, not in samples: a small move of a slow rank's small share can be a large part of
        its time."""
        times = [n / max(s, 1e-12) for n, s in zip(self.split, speeds, strict=True)]
        even = self.global_micro_batch / max(math.fsum(speeds), 1e-12)
        return max(times) > even * (1 + tolerance)

    def _moved(self, fractions: list[float]) -> bool:
        assert self._reference is not None
        limit = math.log(self.rebalance_factor)
        return any(abs(math.log(f / r)) > limit for f, r in zip(fractions, self._reference, strict=True))

    def close(self) -> None:
        """Take the timing hooks off the model."""
        if self.timer is not None:
            self.timer.remove()
            self.timer = None

    def state_dict(self) -> dict[str, Any]:
        return {"split": list(self.split), "reference": self._reference}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """With ``auto``, continue with the saved split when it fits this job (the same global
        micro-batch and world size); fixed weights always give the config's split."""
        split = [int(n) for n in state["split"]]
        if self.auto and len(split) == self.world_size and sum(split) == self.global_micro_batch:
            self.split = split
            self._reference = state["reference"]
