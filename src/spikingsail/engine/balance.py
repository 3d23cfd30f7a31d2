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
from spikingsail.engine.timing import (
    ComputeTimer,
    Z,
    log_variance_of_mean,
    lower_bound,
    spread,
)

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
Bounds = tuple[float, float]
"""A rank's share that evens the ranks' compute lies strictly between these (``Balancer._learn``)."""


def loss_weight(own: int, step: int, world_size: int, accumulation: int) -> float:
    """What a rank's mean loss over ``own`` samples is multiplied by so that the backends' average
    over ``world_size`` ranks and ``accumulation`` micro-steps is the mean over the ``step`` samples of
    the optimizer step. 1 for equal shares of a whole step; for a rank's share of a global micro-batch
    of ``block`` samples, ``world_size × own / block`` (the integers' quotient, as exact as that)."""
    return world_size * accumulation * own / step


@dataclass
class _Measure:
    """Each rank's samples per second of compute over some steps, and the variance of its log."""

    speeds: list[float]
    variances: list[float]

    @staticmethod
    def sums(rows: torch.Tensor) -> torch.Tensor:
        """Per rank, from per-step rows [..., rank, (compute seconds, samples, wall)]: what a measure
        is made of, summed over the steps: Σ seconds, Σ samples, Σ seconds², Σ seconds × samples,
        Σ samples², steps."""
        c, n = rows[..., 0], rows[..., 1]
        out = torch.stack([c, n, c * c, c * n, n * n, torch.ones_like(c)], -1)
        return out if out.dim() == 2 else out.sum(0)

    @staticmethod
    def of(sums: torch.Tensor) -> _Measure:
        """The throughput over the steps (a rank that stalls now and then, a throttled or shared
        device, is as slow as its stalls make it, which a median of steps would hide), and the
        variance of its log as a ratio estimator's: the steps' residuals about it, Σ (nᵢ − R cᵢ)²
        ÷ (k − 1), over k · (mean seconds × R)²."""
        speeds, variances = [], []
        for seconds, samples, c2, cn, n2, k in sums.tolist():
            speed = samples / max(seconds, 1e-12)
            speeds.append(speed)
            residuals = max(n2 - 2 * speed * cn + speed * speed * c2, 0.0)
            ok = k >= 2 and speed > 0 and seconds > 0
            variances.append(residuals / (k - 1) / k / (seconds / k * speed) ** 2 if ok else 0.0)
        return _Measure(speeds, variances)

    @staticmethod
    def of_rows(rows: Sequence[torch.Tensor]) -> _Measure:
        return _Measure.of(_Measure.sums(torch.stack(list(rows))))


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
    unsure: bool = False
    """An earlier comparison of this probe found no neighbour slower, with confidence."""
    turns: int = 0
    """Turns (of ``PROBE_STEPS`` steps) done in this comparison; even: the candidate's."""
    turn: list[torch.Tensor] = field(default_factory=list)
    """This turn's per-step all-reduced rows."""
    walls: dict[bool, list[float]] = field(default_factory=lambda: {False: [], True: []})
    """Every step's wall time (the slowest rank's) under the base (False) and the candidate (True)."""
    totals: dict[bool, list[torch.Tensor]] = field(default_factory=lambda: {False: [], True: []})
    """The per-step rows of the base's (False) and the candidate's (True) turns."""


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
        self._steady = torch.zeros(world_size, 6, dtype=torch.float64)
        """``_Measure.sums`` of every step at the split in use since it took effect (outside probes)."""
        self._reference: list[float] | None = None  # the speed fractions measured at the split in use
        self._reference_variances = [0.0] * world_size  # the variances of their logs
        self._rebase = False
        """The split changed: the next window at it becomes the reference."""
        self._bounds: list[Bounds] = self._no_bounds()
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
        self._steady += _Measure.sums(both)
        if len(self._window) < MEASURE_STEPS:
            return None
        return self._judge(step, rank)

    def _judge(self, step: int, rank: int) -> dict[str, Any] | None:
        """With a full window: split again when a rank's speed moved by the factor, or when the
        split in use is uneven (``_refinement``)."""
        measure = _Measure.of_rows(self._window)
        if self._rebase:  # the first window at a new split: what later windows are compared with,
            # unless a rank's speed changed by the factor within it (its halves tell)
            steps = list(self._window)
            later = _Measure.of_rows(steps[MEASURE_STEPS // 2 :])
            if self._moved(later, _Measure.of_rows(steps[: MEASURE_STEPS // 2])):
                return self._change(step, later, rank, refined=False)
            self._set_reference(measure)
        if self._reference is None or self._moved(measure):
            return self._change(step, measure, rank, refined=False)
        basis = self._refinement(measure)
        return None if basis is None else self._change(step, basis, rank, refined=True)

    def _refinement(self, measure: _Measure) -> _Measure | None:
        """No rank's speed moved by the factor. Shortly after a change, the steps at the new split
        when they show it uneven (a rank's speed per sample need not be the same at another share);
        later, the window when it shows a slow drift, or the steps at this split when, together,
        they show it uneven more surely than one window could. None: the split holds."""
        steady = _Measure.of(self._steady)
        if self._refines:
            if not self._uneven(steady, REFINE_TOLERANCE):
                self._refines = 0
                self._settled(measure.speeds)
                return None
            self._refines -= 1
            return steady
        if self._uneven(measure, DRIFT_TOLERANCE):
            # a drift below the factor needs no haste, and one 8-step window on a shared machine
            # can be 10% off by itself: the same rank must stay the slow one for DRIFT_STEPS
            # more steps (windows sliding over 2 × MEASURE_STEPS steps)
            slowest = self._slowest(measure.speeds)
            self._drift = self._drift + 1 if slowest == self._drift_rank else 1
            self._drift_rank = slowest
            if self._drift < DRIFT_STEPS:
                return None
            self._refines = REFINE_WINDOWS  # measured at the old shares: refined as after a change
            return measure
        if self._steady[0, 5] >= 2 * MEASURE_STEPS and self._uneven(steady, DRIFT_TOLERANCE):
            self._refines = REFINE_WINDOWS
            return steady
        self._drift = 0
        self._settled(measure.speeds)
        return None

    def _set_reference(self, measure: _Measure) -> None:
        self._reference = _fractions(measure.speeds)
        self._reference_variances = _fraction_variances(measure.speeds, measure.variances)
        self._rebase = False

    def _change(self, step: int, measure: _Measure, rank: int, refined: bool) -> dict[str, Any] | None:
        """Split by the measured speeds (corrected by the last probe unless they moved by the factor)."""
        first = self._reference is None
        if not refined:
            self.corrections = [1.0] * self.world_size  # a new situation: what a probe found no longer holds
            self._bounds = self._no_bounds()
            self._refines = REFINE_WINDOWS
        self._set_reference(measure)
        self._window.clear()
        self._drift = 0
        self._learn(measure)
        split = self._target(measure)
        if split == self.split:
            # even within what the measurement can tell, or no whole split lies within the bounds
            self._refines = 0
            self._probe_due = self._probe_due or first or not refined
            return None
        self._probe_due = True
        self._rebase = True
        self._steady.zero_()
        self.split = split
        speeds = measure.speeds
        change = {"step": step, "speeds": [round(s, 3) for s in speeds], "split": split, "refined": refined}
        self.changes.append(change)
        if rank == 0:
            log.info("balance at step %d%s: samples/s per rank %s -> micro-batches %s", step,
                     " (refined)" if refined else "", ", ".join(f"{s:.1f}" for s in speeds), split)  # fmt: skip
        return change

    def _no_bounds(self) -> list[Bounds]:
        return [(0.0, self.global_micro_batch + 1.0)] * self.world_size

    def _learn(self, measure: _Measure) -> None:
        """Narrow each rank's bounds on its even share by the split in use: a rank whose compute took
        significantly longer than an even split's has its even share below its share now, one that
        took significantly less above it. The split then stays within what every split measured so
        far has shown, and converges where a rank's time is not in proportion to its share (a fixed
        cost per step, a CPU quota's periods), which would otherwise swing the split from one side
        of even to the other. A bound that contradicts the new one is older, and is dropped."""
        corrected = self._corrected(measure.speeds)
        even = self.global_micro_batch / max(math.fsum(corrected), 1e-12)
        variances = _fraction_variances(corrected, measure.variances)
        for r, (time, variance) in enumerate(zip(self._times(measure.speeds), variances, strict=True)):
            low, high = self._bounds[r]
            gap, margin = math.log(max(time, 1e-12) / even), Z * math.sqrt(variance)
            if gap - margin > 0:
                low, high = (low if low < self.split[r] else 0.0), self.split[r]
            elif gap + margin < 0:
                low, high = self.split[r], (high if high > self.split[r] else self.global_micro_batch + 1.0)
            self._bounds[r] = (low, high)

    def _target(self, measure: _Measure) -> list[int]:
        """The split the speeds give, each taken one standard error nearer to the speed that would
        make the split in use even (never further from it than the measurement supports: a noisy
        measure moves the split less), and each rank's share within its bounds (their middle where the speeds lead out of
        them); the split in use where the shares would still fall outside."""
        corrected = self._corrected(measure.speeds)
        total = math.fsum(corrected)
        speeds = []
        for n, speed, variance in zip(self.split, corrected, measure.variances, strict=True):
            width = math.exp(math.sqrt(variance))
            speeds.append(min(max(n / self.global_micro_batch * total, speed / width), speed * width))
        shares = [self.global_micro_batch * s / math.fsum(speeds) for s in speeds]
        shares = [
            x if low < x < high else (low + high) / 2
            for x, (low, high) in zip(shares, self._bounds, strict=True)
        ]
        split = split_batch(self.global_micro_batch, shares)
        if any(not low < n < high for n, (low, high) in zip(split, self._bounds, strict=True)):
            return list(self.split)
        return split

    def _settled(self, speeds: list[float]) -> None:
        """The split holds still: probe its neighbours if no probe has since the last change."""
        if not self._probe_due:
            return
        self._probe_due = False
        self._window.clear()
        self._next_comparison(self.split, self.split, -1, 0, speeds)

    def _next_comparison(
        self,
        start: list[int],
        base: list[int],
        direction: int,
        kept: int,
        speeds: list[float],
        unsure: bool = False,
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
        self._probe = _Probe(start, base, candidate, direction, kept, unsure)
        self.split = candidate  # the candidate's turn first
        self._steady.zero_()
        return True

    def _probe_step(self, step: int, both: torch.Tensor, rank: int) -> dict[str, Any] | None:
        """One step of a probe: add it to the turn; at a turn's end, switch splits or decide."""
        probe = self._probe
        assert probe is not None
        candidate = probe.turns % 2 == 0
        probe.turn.append(both)
        probe.walls[candidate].append(float(both[:, 2].max()))  # the step waits for the slowest rank
        if len(probe.turn) < PROBE_STEPS:
            return None
        turn, probe.turn = probe.turn, []
        probe.turns += 1
        probe.totals[candidate].extend(turn)
        measure = _Measure.of_rows(turn)
        if self._reference is not None and self._moved(measure):
            self._probe = None  # a rank's speed changed by the factor: split again at once
            return self._change(step, measure, rank, refined=False)
        if probe.turns < 2 * PROBE_ROUNDS:
            self.split = probe.base if candidate else probe.candidate
            return None
        # the candidate is kept when its steps ran faster than the base's by the margin, with
        # confidence: a neighbour that only seems faster on a noisy machine is not worth a move
        base, faster = spread(probe.walls[False]), spread(probe.walls[True])
        count = len(probe.walls[False])
        gain = base[0] / max(faster[0], 1e-12)
        variance = log_variance_of_mean(*base, count) + log_variance_of_mean(*faster, count)
        if rank == 0:
            log.debug("balance probe at step %d: steps %.3f× faster at %s than at %s", step,
                      gain, probe.candidate, probe.base)  # fmt: skip
        self._probe = None
        if lower_bound(gain, variance) > 1 + PROBE_MARGIN:
            kept = probe.kept + 1
            if kept < PROBE_MOVES and self._next_comparison(
                probe.start, probe.candidate, probe.direction, kept, measure.speeds
            ):
                return None
            # the most moves one probe makes: another probe continues from here after a window
            self._probe_due = True
            return self._probed(step, probe.start, probe.candidate, probe.totals[True], rank)
        # the base is even by the steps' time only where its neighbours ran slower, with confidence
        unsure = probe.unsure or lower_bound(1 / gain, variance) <= 1
        if (
            probe.kept == 0
            and probe.direction < 0
            and self._next_comparison(probe.start, probe.base, 1, 0, measure.speeds, unsure)
        ):
            return None
        return self._probed(step, probe.start, probe.base, probe.totals[False], rank, even=not unsure)

    def _probed(
        self,
        step: int,
        start: list[int],
        split: list[int],
        rows: list[torch.Tensor],
        rank: int,
        even: bool = True,
    ) -> dict[str, Any] | None:
        """A probe's end: ``split`` stays, and it becomes the even split of the speeds measured at
        it during the probe (``rows``: the steps of its turns). The later checks look for a change
        from those speeds: what a rank's timer reports at a share need not be what that share costs
        the step (its side of the all-reduce, a quota's periods), and the probe has found by the
        steps' time what the timers would not."""
        self.split = split
        measure = _Measure.of_rows(rows)
        self._set_reference(measure)
        self._steady = _Measure.sums(torch.stack(rows))
        if even:  # else the steps could not tell: the measured speeds keep their say
            self._bounds = self._no_bounds()
            total = math.fsum(measure.speeds)
            # corrected speeds proportional to the split: the drift check finds it even
            self.corrections = [
                n / self.global_micro_batch * total / max(s, 1e-12)
                for n, s in zip(split, measure.speeds, strict=True)
            ]
        if split == start:
            return None
        change = {"step": step, "speeds": [round(s, 3) for s in measure.speeds], "split": split,
                  "refined": False, "probed": True}  # fmt: skip
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

    def _uneven(self, measure: _Measure, tolerance: float) -> bool:
        """Whether, at the split in use and the speeds measured at it, the slowest rank's compute
        took more than ``tolerance`` longer than an even split's would, with confidence (``Z``
        standard errors of the slowest rank's share of the speed). A criterion in time, not in
        samples: a small move of a slow rank's small share can be a large part of its time."""
        corrected = self._corrected(measure.speeds)
        even = self.global_micro_batch / max(math.fsum(corrected), 1e-12)
        slowest = self._slowest(measure.speeds)
        variance = _fraction_variances(corrected, measure.variances)[slowest]
        return lower_bound(self._times(measure.speeds)[slowest] / even, variance) > 1 + tolerance

    def _moved(self, measure: _Measure, reference: _Measure | None = None) -> bool:
        """Whether a rank's share of the total speed moved from the reference (or ``reference``) by
        more than the factor, with confidence (``Z`` standard errors of both measurements)."""
        fractions, variances = (
            _fractions(measure.speeds),
            _fraction_variances(measure.speeds, measure.variances),
        )
        if reference is not None:
            before = _fractions(reference.speeds)
            spreads = _fraction_variances(reference.speeds, reference.variances)
        else:
            assert self._reference is not None
            before, spreads = self._reference, self._reference_variances
        limit = math.log(self.rebalance_factor)
        return any(
            abs(math.log(f / r)) - Z * math.sqrt(v + w) > limit
            for f, r, v, w in zip(fractions, before, variances, spreads, strict=True)
        )

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
        micro-batch and world size); fixed weights always give the config's split. The resumed job
        measures its own reference at that split (another machine, another load)."""
        split = [int(n) for n in state["split"]]
        if self.auto and len(split) == self.world_size and sum(split) == self.global_micro_batch:
            self.split = split
            self._reference = state["reference"]
            self.corrections = [float(c) for c in state.get("corrections", [1.0] * self.world_size)]
            self._probe_due = True
            self._rebase = True


def _fractions(speeds: list[float]) -> list[float]:
    """Each rank's share of the total speed."""
    total = math.fsum(speeds)
    return [s / total for s in speeds]


def _fraction_variances(speeds: list[float], variances: list[float]) -> list[float]:
    """The variance of the log of each rank's share of the total speed, from the variances of the
    speeds' logs (independent ranks): d log fᵣ = (1 − fᵣ) d log sᵣ − Σⱼ≠ᵣ fⱼ d log sⱼ."""
    fractions = _fractions(speeds)
    return [
        (1 - fractions[r]) ** 2 * variances[r]
        + math.fsum(f * f * v for j, (f, v) in enumerate(zip(fractions, variances, strict=True)) if j != r)
        for r in range(len(speeds))
    ]
