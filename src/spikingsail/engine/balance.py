"""Unequal per-rank micro-batches for ranks of unequal speed (``"sail": {"balance": ...}``).

Every global micro-batch (``train_batch_size / gradient_accumulation_steps`` samples) is split into
per-rank shares: fixed weights, or ``auto``, measured. The data loader hands each rank its slice of
the global order (``StepBatchSampler``), so a step sees the samples one process would, and
each rank's loss is weighted by its share (``loss_weight``), so that the average the backends take
over ranks and micro-steps is the mean over the whole optimizer step: the step one process would
take, whatever the split. The same weighting makes an epoch's short last step exact on any split
(with or without balance).

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
compute over the last ``MEASURE_STEPS`` steps took more than ``DRIFT_TOLERANCE`` longer than even,
at each of ``DRIFT_STEPS`` steps in a row (a slow drift of a rank's speed, below the factor).
Once the split holds still after a change, ``auto`` probes its neighbours by what the step costs end
to end: it moves ``PROBE_FRACTION`` of the slowest rank's share to the fastest rank (and, if that is
not faster, the other way), runs the two splits in turn for ``PROBE_ROUNDS`` rounds of
``PROBE_STEPS`` steps each, and keeps a neighbour whose steps were more than ``PROBE_MARGIN`` faster,
then tries the next one the same way (``PROBE_MOVES`` at most; a probe that keeps that many is
followed by another one a window later). Compute times even out the ranks' work, but what a step
costs also depends on how the ranks' work and waits fall together (a CPU quota's periods, two
processes sharing cores, the overlap of the all-reduce with backward), which only the step's own
time shows. The speeds measured at the split a probe ends on, during the probe, become the even
ones: a correction of each rank's speed, so that the later checks look for a change from them (a
timer's report need not scale with the share); a change by the factor drops it and probes again.
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
from dataclasses import dataclass, field
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
DRIFT_STEPS = MEASURE_STEPS
"""Steps in a row at which the drift check must find the same rank slow before it splits again."""
PROBE_FRACTION = 0.08
"""A probe moves this fraction of the slowest rank's share (at least one sample) to or from the fastest."""
PROBE_STEPS = 4
"""Steps a probed split runs before the other one of the pair takes over."""
PROBE_ROUNDS = 4
"""Turns of each split in one comparison: ``2 × PROBE_ROUNDS × PROBE_STEPS`` steps, the two splits
interleaved so that a change of the machine's load meets both alike."""
PROBE_MARGIN = 0.03
"""How much faster (steps per second) a neighbour must run to be kept."""
PROBE_MOVES = 3
"""Neighbours kept one after another in one probe, at most."""


def loss_weight(own: int, step: int, world_size: int, accumulation: int) -> float:
    """What a rank's mean loss over ``own`` samples is multiplied by so that the backends' average
    over ``world_size`` ranks and ``accumulation`` micro-steps is the mean over the ``step`` samples of
    the optimizer step. 1 for equal shares of a whole step; for a rank's share of a global micro-batch
    of ``block`` samples, ``world_size × own / block`` (the integers' quotient, as exact as that)."""
    return world_size * accumulation * own / step


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

    def take(self) -> tuple[float, int, float]:
        """(compute seconds, samples, wall seconds) since the last ``restart``."""
        step = self.clock.seconds(self._start, self.clock.mark())
        waited = sum(self.clock.seconds(a, b) for a, b in self._waits)
        out = (max(step - waited, 1e-9), self.samples, step)
        self._waits.clear()
        self.samples = 0
        return out

    def restart(self) -> None:
        self._start = self.clock.mark()

    def remove(self) -> None:
        self.last_gradient.remove()


@dataclass
class _Probe:
    """A comparison of the split in use (``base``) with a neighbour, by the wall time of their steps."""

    start: list[int]
    """The split before the probe: where a probe that keeps no neighbour ends."""
    base: list[int]
    candidate: list[int]
    direction: int
    """-1: the slowest rank gives samples to the fastest; +1: it takes some."""
    kept: int = 0
    turns: int = 0
    """Turns (of ``PROBE_STEPS`` steps) done in this comparison; even: the candidate's."""
    steps: int = 0
    wall: dict[bool, float] = field(default_factory=lambda: {False: 0.0, True: 0.0})
    """Seconds of the base's (False) and the candidate's (True) turns; each runs ``PROBE_ROUNDS`` turns."""
    turn: torch.Tensor | None = None
    """This turn's per-rank (compute seconds, samples, wall seconds), summed over its steps."""
    totals: dict[bool, torch.Tensor] = field(default_factory=dict)
    """The same, summed over the base's (False) and the candidate's (True) turns."""


class Balancer:
    """The current split of the global micro-batch, and for ``auto`` the measurement that sets it."""

    def __init__(
        self,
        *,
        global_micro_batch: int,
        world_size: int,
        weights: Sequence[float] | None,
        rebalance_factor: float,
        accumulation: int = 1,
    ) -> None:
        """``weights`` None: ``auto`` (equal shares until measured)."""
        self.global_micro_batch = global_micro_batch
        self.world_size = world_size
        self.accumulation = accumulation
        self.auto = weights is None
        self.rebalance_factor = rebalance_factor
        self.split = split_batch(
            global_micro_batch, list(weights) if weights is not None else [1.0] * world_size
        )
        self.timer: ComputeTimer | None = None
        self._steps = 0
        self._window: deque[torch.Tensor] = deque(
            maxlen=MEASURE_STEPS
        )  # per step: [rank, (compute seconds, samples, wall seconds)]
        self._reference: list[float] | None = None  # the speed fractions the split was made from
        self._refines = 0
        self.corrections = [1.0] * world_size
        """Per-rank factors on the measured speeds, from the last probe: the split they give is the probed one."""
        self._probe: _Probe | None = None
        self._probe_due = False
        self._drift = 0
        """Consecutive steps at which the drift check found ``_drift_rank`` the slow rank."""
        self._drift_rank = -1
        self.changes: list[dict[str, Any]] = []
        """Every change of split, for the monitor: step, speeds (samples/s), split."""

    def shares(self) -> list[int]:
        return self.split

    @property
    def settled(self) -> bool:
        """``auto``: measured, refined and probed; the split holds until a rank's speed changes."""
        return (
            self._reference is not None and self._probe is None and not self._probe_due and not self._refines
        )

    def loss_weight(self, own: int, step: int) -> float:
        """``loss_weight`` at this job's world size and accumulation."""
        return loss_weight(own, step, self.world_size, self.accumulation)

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
        seconds, samples, wall = self.timer.take()
        self._steps += 1
        if self._steps <= WARMUP_STEPS:
            self.timer.restart()
            return None
        mine = torch.zeros(self.world_size, 3, dtype=torch.float64)
        mine[rank] = torch.tensor([seconds, samples, wall], dtype=torch.float64)
        both = all_reduce_sum(mine)
        self.timer.restart()  # after the collective: its wait for the slowest rank is not compute
        if self._probe is not None:
            return self._probe_step(step, both, rank)
        self._window.append(both)
        if len(self._window) < MEASURE_STEPS:
            return None
        # throughput over the whole window: a rank that stalls now and then (a throttled or shared
        # device) is as slow as its stalls make it, which a median of steps would hide
        speeds = _speeds(torch.stack(list(self._window)).sum(0))
        fractions = _fractions(speeds)
        refined = False
        if self._reference is not None and not self._moved(fractions):
            # no rank's speed moved by the factor. Shortly after a change, take a split that evens
            # the ranks' times better, measured at the split now in use (a rank's speed per sample
            # need not be the same at another share); later, one that corrects a slow drift.
            if self._refines:
                if not self._uneven(speeds, REFINE_TOLERANCE):
                    self._refines = 0
                    self._settled(speeds)
                    return None
                self._refines -= 1
            elif self._uneven(speeds, DRIFT_TOLERANCE):
                # a drift below the factor needs no haste, and one 8-step window on a shared machine
                # can be 10% off by itself: the same rank must stay the slow one for DRIFT_STEPS
                # more steps (windows sliding over 2 × MEASURE_STEPS steps)
                slowest = self._slowest(speeds)
                self._drift = self._drift + 1 if slowest == self._drift_rank else 1
                self._drift_rank = slowest
                if self._drift < DRIFT_STEPS:
                    return None
                self._refines = REFINE_WINDOWS  # measured at the old shares: refined as after a change
            else:
                self._drift = 0
                self._settled(speeds)
                return None
            refined = True
        return self._change(step, speeds, fractions, rank, refined)

    def _change(
        self, step: int, speeds: list[float], fractions: list[float], rank: int, refined: bool
    ) -> dict[str, Any] | None:
        """Split by the measured ``speeds`` (corrected by the last probe unless they moved by the factor)."""
        if not refined:
            self.corrections = [1.0] * self.world_size  # a new situation: what a probe found no longer holds
            self._refines = REFINE_WINDOWS
        self._probe_due = True
        self._reference = fractions
        self._window.clear()
        self._drift = 0
        split = split_batch(self.global_micro_batch, self._corrected(speeds))
        if split == self.split:
            return None
        self.split = split
        change = {"step": step, "speeds": [round(s, 3) for s in speeds], "split": split, "refined": refined}
        self.changes.append(change)
        if rank == 0:
            log.info("balance at step %d%s: samples/s per rank %s -> micro-batches %s", step,
                     " (refined)" if refined else "", ", ".join(f"{s:.1f}" for s in speeds), split)  # fmt: skip
        return change

    def _settled(self, speeds: list[float]) -> None:
        """The split holds still: probe its neighbours if no probe has since the last change."""
        if not self._probe_due:
            return
        self._probe_due = False
        self._window.clear()
        self._next_comparison(self.split, self.split, -1, 0, speeds)

    def _next_comparison(
        self, start: list[int], base: list[int], direction: int, kept: int, speeds: list[float]
    ) -> bool:
        """Begin comparing ``base`` with its neighbour in ``direction``; False when it has none."""
        slow = min(range(self.world_size), key=lambda r: speeds[r])
        fast = max(range(self.world_size), key=lambda r: speeds[r])
        delta = max(1, round(PROBE_FRACTION * base[slow]))
        candidate = list(base)
        candidate[slow] += direction * delta
        candidate[fast] -= direction * delta
        if slow == fast or min(candidate) < 1:
            return False
        self._probe = _Probe(start=start, base=base, candidate=candidate, direction=direction, kept=kept)
        self.split = candidate  # the candidate's turn first
        return True

    def _probe_step(self, step: int, both: torch.Tensor, rank: int) -> dict[str, Any] | None:
        """One step of a probe: add it to the turn; at a turn's end, switch splits or decide."""
        probe = self._probe
        assert probe is not None
        probe.turn = both if probe.turn is None else probe.turn + both
        probe.steps += 1
        if probe.steps < PROBE_STEPS:
            return None
        turn, candidate = probe.turn, probe.turns % 2 == 0
        probe.turn, probe.steps = None, 0
        probe.turns += 1
        probe.wall[candidate] += float(turn[:, 2].max())
        probe.totals[candidate] = turn if candidate not in probe.totals else probe.totals[candidate] + turn
        speeds = _speeds(turn)
        fractions = _fractions(speeds)
        if self._reference is not None and self._moved(fractions):
            self._probe = None  # a rank's speed changed by the factor: split again at once
            return self._change(step, speeds, fractions, rank, refined=False)
        if probe.turns < 2 * PROBE_ROUNDS:
            self.split = probe.base if candidate else probe.candidate
            return None
        rates = {c: PROBE_ROUNDS * PROBE_STEPS / max(probe.wall[c], 1e-12) for c in (False, True)}
        if rank == 0:
            log.debug("balance probe at step %d: steps/s %.3f at %s, %.3f at %s", step,
                      rates[False], probe.base, rates[True], probe.candidate)  # fmt: skip
        self._probe = None
        if rates[True] > rates[False] * (1 + PROBE_MARGIN):
            kept = probe.kept + 1
            if kept < PROBE_MOVES and self._next_comparison(
                probe.start, probe.candidate, probe.direction, kept, speeds
            ):
                return None
            # the most moves one probe makes: another probe continues from here after a window
            self._probe_due = True
            return self._probed(step, probe.start, probe.candidate, probe.totals[True], rank)
        if (
            probe.kept == 0
            and probe.direction < 0
            and self._next_comparison(probe.start, probe.base, 1, 0, speeds)
        ):
            return None
        return self._probed(step, probe.start, probe.base, probe.totals[False], rank)

    def _probed(
        self, step: int, start: list[int], split: list[int], measured: torch.Tensor, rank: int
    ) -> dict[str, Any] | None:
        """A probe's end: ``split`` stays, and it becomes the even split of the speeds measured at
        it during the probe (``measured``: the sums of its turns). The later checks look for a
        change from those speeds: what a rank's timer reports at a share need not be what that
        share costs the step (its side of the all-reduce, a quota's periods), and the probe has
        found by the steps' time what the timers would not."""
        self.split = split
        speeds = _speeds(measured)
        self._reference = _fractions(speeds)
        total = math.fsum(speeds)
        # corrected speeds proportional to the split: the drift check finds it even
        self.corrections = [
            n / self.global_micro_batch * total / max(s, 1e-12) for n, s in zip(split, speeds, strict=True)
        ]
        if split == start:
            return None
        change = {"step": step, "speeds": [round(s, 3) for s in speeds], "split": split, "refined": False,
                  "probed": True}  # fmt: skip
        self.changes.append(change)
        if rank == 0:
            log.info("balance at step %d (probed): micro-batches %s ran faster than %s", step, split, start)
        return change

    def _corrected(self, speeds: list[float]) -> list[float]:
        return [s * c for s, c in zip(speeds, self.corrections, strict=True)]

    def _times(self, speeds: list[float]) -> list[float]:
        """Each rank's compute time for its share of the split in use, at the (corrected) ``speeds``."""
        return [n / max(s, 1e-12) for n, s in zip(self.split, self._corrected(speeds), strict=True)]

    def _slowest(self, speeds: list[float]) -> int:
        """The rank whose compute at the split in use takes longest."""
        times = self._times(speeds)
        return times.index(max(times))

    def _uneven(self, speeds: list[float], tolerance: float) -> bool:
        """Whether, at the split in use and the ``speeds`` (samples/s) measured at it, the slowest
        rank's compute took more than ``tolerance`` longer than an even split's would. A criterion
        in time, not in samples: a small move of a slow rank's small share can be a large part of
        its time."""
        even = self.global_micro_batch / max(math.fsum(self._corrected(speeds)), 1e-12)
        return max(self._times(speeds)) > even * (1 + tolerance)

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
        return {
            "split": list(self.split),
            "reference": self._reference,
            "corrections": list(self.corrections),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """With ``auto``, continue with the saved split when it fits this job (the same global
        micro-batch and world size); fixed weights always give the config's split."""
        split = [int(n) for n in state["split"]]
        if self.auto and len(split) == self.world_size and sum(split) == self.global_micro_batch:
            self.split = split
            self._reference = state["reference"]
            self.corrections = [float(c) for c in state.get("corrections", [1.0] * self.world_size)]
            self._probe_due = True


def _fractions(speeds: list[float]) -> list[float]:
    """Each rank's share of the total speed."""
    total = math.fsum(speeds)
    return [s / total for s in speeds]


def _speeds(totals: torch.Tensor) -> list[float]:
    """Samples per second of compute, per rank, from summed (compute seconds, samples, wall) rows."""
    return [float(n) / max(float(t), 1e-12) for t, n in totals[:, :2].tolist()]
