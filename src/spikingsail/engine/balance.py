"""Unequal per-rank micro-batches for ranks of unequal speed (``"sail": {"balance": ...}``).

Every global micro-batch (``train_batch_size / gradient_accumulation_steps`` samples) is split into
per-rank shares: fixed weights, or ``auto``, measured. The data loader hands each rank its slice of
the global order (``StepBatchSampler``), so a step sees the samples one process would, and
each rank's loss is weighted by its share (``loss_weight``), so that the average the backends take
over ranks and micro-steps is the mean over the whole optimizer step: the step one process would
take, whatever the split. The same weighting makes an epoch's short last step exact on any split
(with or without balance).

``auto`` measures each rank's compute time per optimizer step: the step's time less its wait for
the others at the end of backward (``ComputeTimer``). After a warm-up step it measures
``MEASURE_STEPS`` steps and splits in proportion to the ranks' samples per second, then keeps
watching, and moves only on evidence: each speed comes with the variance of its log, from the steps'
own spread (``timing.SpeedMeasure``), and a difference counts when it passes its threshold by ``Z``
standard errors. It splits again when a rank's share of the total speed moved by more than
``rebalance_factor`` from the reference (the first window measured at the split in use, so that a
speed that depends on the share does not count as a move; the steps since the split changed hold a
change where a cut in two shows the factor, and a window whose halves differ is no reference for up
to ``REBASE_STEPS`` steps); in the ``REFINE_WINDOWS`` windows after a change, when the steps at the new split
show the slowest rank's compute more than ``REFINE_TOLERANCE`` longer than even; later, when it is
``DRIFT_TOLERANCE`` longer over a window at each of ``DRIFT_STEPS`` steps in a row, or over all the
steps at this split together. A new split moves each speed one standard error towards the split in
use and keeps each rank's share within the bounds that earlier splits have shown for its even share
(``_learn``): where time is not in proportion to the share (a fixed cost per step, a CPU quota's
periods) the split narrows in on even times instead of swinging across them. Once it holds still,
``auto`` probes its neighbours by the steps' wall time (``PROBE_*``: a move of ``PROBE_FRACTION`` of
the slowest rank's share, the two splits run in turns), keeps a neighbour faster by ``PROBE_MARGIN``
with confidence, and, where the neighbours ran slower with confidence, takes the speeds measured at
the split as its even ones (a per-rank correction: a timer's report need not scale with the share).
Every rank decides from the same all-reduced numbers, so the split changes at the same step
everywhere. Backends whose ranks also wait for each other inside forward and backward (FSDP's
all-gathers) would hide the difference there; they take fixed weights only.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from spikingsail.data.sampler import split_batch
from spikingsail.engine.split_search import PROBE_MOVES, Probe, ShareBounds
from spikingsail.engine.timing import (
    ComputeTimer,
    SpeedMeasure,
    Step,
    Z,
    cuts,
    fractions,
    lower_bound,
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
REBASE_STEPS = 3 * MEASURE_STEPS
"""After a change of split, the most steps the reference waits for a window whose halves agree."""


def loss_weight(own: int, step: int, world_size: int, accumulation: int) -> float:
    """What a rank's mean loss over ``own`` samples is multiplied by so that the backends' average
    over ``world_size`` ranks and ``accumulation`` micro-steps is the mean over the ``step`` samples of
    the optimizer step. 1 for equal shares of a whole step; for a rank's share of a global micro-batch
    of ``block`` samples, ``world_size × own / block`` (the integers' quotient, as exact as that)."""
    return world_size * accumulation * own / step


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
        self._window: deque[Step] = deque(
            maxlen=MEASURE_STEPS
        )  # per step: [rank, (compute seconds, samples, wall seconds)]
        self._steady = SpeedMeasure.sums([], [[0.0] * 6 for _ in range(world_size)])
        """``SpeedMeasure.sums`` of the steps at the split in use (from its reference on; outside probes)."""
        self._reference: list[float] | None = None  # the speed fractions measured at the split in use
        self._reference_variances = [0.0] * world_size  # the variances of their logs
        self._rebase = False
        """The split changed: the next window at it becomes the reference."""
        self._since: list[Step] = []
        """While ``_rebase``: the steps at the new split, searched for a change of a rank's speed."""
        self._bounds = ShareBounds(global_micro_batch, world_size)
        self._refines = 0
        self.corrections = [1.0] * world_size
        """Per-rank factors on the measured speeds, from the last probe: the split they give is the probed one."""
        self._probe: Probe | None = None
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
        both = all_reduce_sum(mine).tolist()
        self.timer.restart()  # after the collective: its wait for the slowest rank is not compute
        if self._probe is not None:
            return self._probe_step(step, both, rank)
        self._window.append(both)
        if self._rebase:
            self._since.append(both)
        SpeedMeasure.sums([both], self._steady)
        if len(self._window) < MEASURE_STEPS:
            return None
        return self._judge(step, rank)

    def _judge(self, step: int, rank: int) -> dict[str, Any] | None:
        """With a full window: split again when a rank's speed moved by the factor, or when the
        split in use is uneven (``_refinement``)."""
        measure = SpeedMeasure.of_steps(self._window)
        if self._rebase:  # the first window at a new split: what later windows are compared with,
            # unless a rank's speed changed since the split did
            later = self._changed_since_split()
            if later is not None:
                return self._change(step, later, rank, refined=False)
            steps, half = list(self._window), MEASURE_STEPS // 2
            if len(self._since) < REBASE_STEPS and self._moved(
                SpeedMeasure.of_steps(steps[half:]), SpeedMeasure.of_steps(steps[:half]), z=0.0
            ):  # perhaps: the window slides on until its halves agree (measured only while it may)
                return None
            self._set_reference(measure)
            self._steady = SpeedMeasure.sums(steps)  # the steps at this split: from the reference on
        if self._reference is None or self._moved(measure):
            return self._change(step, measure, rank, refined=False)
        basis = self._refinement(measure)
        return None if basis is None else self._change(step, basis, rank, refined=True)

    def _changed_since_split(self) -> SpeedMeasure | None:
        """The steps after the likeliest change of a rank's speed since the split changed (at any
        step with half a window on each side: the longer the runs, the surer), where the steps
        before and after it differ by the factor with confidence; None where no cut shows that."""
        best, after = Z, None
        for before, later in cuts(self._since, MEASURE_STEPS // 2):
            evidence = self._evidence(later, before)
            if evidence > best:
                best, after = evidence, later
        return after

    def _refinement(self, measure: SpeedMeasure) -> SpeedMeasure | None:
        """No rank's speed moved by the factor. Shortly after a change, the steps at the new split
        when they show it uneven (a rank's speed per sample need not be the same at another share);
        later, the window when it shows a slow drift, or the steps at this split when, together,
        they show it uneven more surely than one window could. None: the split holds."""
        steady = SpeedMeasure.of(self._steady)
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
        if self._steady[0][5] >= 2 * MEASURE_STEPS and self._uneven(steady, DRIFT_TOLERANCE):
            self._refines = REFINE_WINDOWS
            return steady
        self._drift = 0
        self._settled(measure.speeds)
        return None

    def _set_reference(self, measure: SpeedMeasure) -> None:
        self._reference = fractions(measure.speeds)
        self._reference_variances = measure.fraction_variances()
        self._rebase = False
        self._since = []

    def _change(self, step: int, measure: SpeedMeasure, rank: int, refined: bool) -> dict[str, Any] | None:
        """Split by the measured speeds (corrected by the last probe unless they moved by the factor)."""
        first = self._reference is None
        if not refined:
            self.corrections = [1.0] * self.world_size  # a new situation: what a probe found no longer holds
            self._bounds.reset()
            self._refines = REFINE_WINDOWS
        self._set_reference(measure)
        self._window.clear()
        self._drift = 0
        corrected = SpeedMeasure(self._corrected(measure.speeds), measure.variances)
        self._bounds.learn(self.split, corrected)
        split = self._bounds.target(self.split, corrected)
        if split == self.split:
            # even within what the measurement can tell, or no whole split lies within the bounds
            self._refines = 0
            self._probe_due = self._probe_due or first or not refined
            return None
        self._probe_due = True
        self._rebase = True
        self._steady = [[0.0] * 6 for _ in range(self.world_size)]
        self.split = split
        speeds = measure.speeds
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
        self,
        start: list[int],
        base: list[int],
        direction: int,
        kept: int,
        speeds: list[float],
        unsure: bool = False,
    ) -> bool:
        """Begin comparing ``base`` with its neighbour in ``direction``; False when it has none."""
        probe = Probe.around(start, base, direction, kept, speeds, unsure)
        if probe is None:
            return False
        self._probe, self.split = probe, probe.split  # the candidate's turn first
        self._steady = [[0.0] * 6 for _ in range(self.world_size)]
        return True

    def _probe_step(self, step: int, both: Step, rank: int) -> dict[str, Any] | None:
        """One step of a probe: add it to the turn; at a turn's end, switch splits or decide."""
        probe = self._probe
        assert probe is not None
        measure = probe.add(both)
        if measure is None:
            return None
        if self._reference is not None and self._moved(measure):
            self._probe = None  # a rank's speed changed by the factor: split again at once
            return self._change(step, measure, rank, refined=False)
        if not probe.done:
            self.split = probe.split
            return None
        self._probe = None
        faster, slower = probe.verdict(step, rank)
        if faster:
            kept = probe.kept + 1
            if kept < PROBE_MOVES and self._next_comparison(
                probe.start, probe.candidate, probe.direction, kept, measure.speeds
            ):
                return None
            # the most moves one probe makes: another probe continues from here after a window
            self._probe_due = True
            return self._probed(step, probe.start, probe.candidate, probe.totals[True], rank)
        # the base is even by the steps' time only where its neighbours ran slower, with confidence
        unsure = probe.unsure or not slower
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
        rows: list[Step],
        rank: int,
        even: bool = True,
    ) -> dict[str, Any] | None:
        """A probe's end: ``split`` stays, and it becomes the even split of the speeds measured at
        it during the probe (``rows``: the steps of its turns). The later checks look for a change
        from those speeds: what a rank's timer reports at a share need not be what that share costs
        the step (its side of the all-reduce, a quota's periods), and the probe has found by the
        steps' time what the timers would not."""
        self.split = split
        measure = SpeedMeasure.of_steps(rows)
        self._set_reference(measure)
        self._steady = SpeedMeasure.sums(rows)
        if even:  # else the steps could not tell: the measured speeds keep their say
            self._bounds.reset()
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

    def _uneven(self, measure: SpeedMeasure, tolerance: float) -> bool:
        """Whether, at the split in use and the speeds measured at it, the slowest rank's compute
        took more than ``tolerance`` longer than an even split's would, with confidence (``Z``
        standard errors of the slowest rank's share of the speed). A criterion in time, not in
        samples: a small move of a slow rank's small share can be a large part of its time."""
        corrected = self._corrected(measure.speeds)
        even = self.global_micro_batch / max(math.fsum(corrected), 1e-12)
        slowest = self._slowest(measure.speeds)
        variance = SpeedMeasure(corrected, measure.variances).fraction_variances()[slowest]
        return lower_bound(self._times(measure.speeds)[slowest] / even, variance) > 1 + tolerance

    def _moved(self, measure: SpeedMeasure, reference: SpeedMeasure | None = None, z: float = Z) -> bool:
        """Whether a rank's share of the total speed moved from the reference (or ``reference``) by
        more than the factor, with confidence (``z`` standard errors of both measurements)."""
        return self._evidence(measure, reference) > z

    def _evidence(self, measure: SpeedMeasure, reference: SpeedMeasure | None = None) -> float:
        """By how many standard errors (of both measurements) a rank's share of the total speed moved
        from the reference (or ``reference``) by more than the factor: the most of any rank's."""
        shares, variances = fractions(measure.speeds), measure.fraction_variances()
        if reference is not None:
            before = fractions(reference.speeds)
            spreads = reference.fraction_variances()
        else:
            assert self._reference is not None
            before, spreads = self._reference, self._reference_variances
        limit, most = math.log(self.rebalance_factor), -math.inf
        for f, r, v, w in zip(shares, before, variances, spreads, strict=True):
            excess, error = abs(math.log(f / r)) - limit, math.sqrt(v + w)
            most = max(most, excess / error if error > 0 else math.inf if excess > 0 else -math.inf)
        return most

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
