"""Where each rank's step time goes, and which rank holds the others up (``sail.straggler_window``).

Each rank marks the engine's own phases with timestamps (CUDA events on a GPU, where the host runs
ahead of the kernels):

data       from the end of one engine call to the next forward: the script's loop, the batch loading
forward    ``engine(batch)``
backward   ``engine.backward(loss)`` up to this rank's last gradient
comm       the rest of backward: the wait for the other ranks' gradients (DDP's and Horovod's
           all-reduce end there)
optimizer  ``engine.step()``

Every ``window`` optimizer steps the ranks sum their phases in one small all-reduce at the step
boundary (never inside a phase), with each rank's number of steps and the spread of its per-step
work (every phase but comm) about its mean. A rank's score is its work over the median of the other
ranks' work. A rank is a straggler when its score has stayed at or above ``factor`` for at least
``PERSISTENT_WINDOWS`` windows in a row after the window it turned slow in (persistence: that window
holds only part of its slow steps; from the run's first window on there is none) and the lower
confidence bound of its score over those windows, ``Z`` standard errors below it, is at or above
``factor`` too (significance).
A window's standard error is the larger of what the per-step spread of the rank's work and of the
median rank's gives and what the scores' spread from one window to the next has been
(``between_windows``: a shared machine's load comes in episodes of seconds, on one rank and then
another, which one window's steps cannot show); over a run of windows it shrinks as the run grows.
So a rank that stays slow is named however noisy its steps, and a balanced rank whose mean sits
above the others' for a few windows, or whose steps stall now and then, is not. Rank 0 warns once,
naming its rank and host, until it recovers.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from spikingsail.engine.hooks import StepNotes
from spikingsail.engine.timing import Clock, LastGradient, log_variance_of_mean, lower_bound

log = logging.getLogger(__name__)

PHASES = ("data", "forward", "backward", "comm", "optimizer")
_DATA, _FORWARD, _BACKWARD, _COMM, _OPTIMIZER = range(len(PHASES))
_STEP = "step"
"""The first item of an optimizer step's span."""
STEPS, DEVIATIONS = len(PHASES), len(PHASES) + 1
"""Columns of the window's all-reduce after the phases' sums: steps, and the sum of squared deviations
of the rank's per-step work from its mean."""
PERSISTENT_WINDOWS = 3
HISTORY_WINDOWS = 16
"""Windows over which a rank's scores' spread from window to window is estimated."""
Log = tuple[float, float]
"""A score's log and that log's variance."""


class StragglerWatch:
    """The breakdown's step hooks on one rank; ``all_reduce_sum`` and ``hosts`` (every rank's host
    name) are collectives, called at the same window on every rank."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        *,
        rank: int,
        world_size: int,
        window: int,
        factor: float,
        all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
        hosts: Callable[[], list[str]],
    ) -> None:
        self.clock = Clock(device.type == "cuda")
        self.model = model
        self.rank = rank
        self.world_size = world_size
        self.window = window
        self.factor = factor
        self._all_reduce_sum, self._hosts = all_reduce_sum, hosts
        self._spans: list[tuple[Any, ...]] = []  # resolved at the window's end
        self._last_end: Any = None
        self._data_start: Any = None
        self._forward_start: Any = None
        self._backward_start: Any = None
        self._steps = 0
        self._history = ScoreHistory(world_size)
        self._streaks = [
            (0, 0.0, 0.0)
        ] * world_size  # per rank: windows in a row at the factor, Σ log score, Σ variance
        self._warned: set[int] = set()
        self._onsets: set[int] = set()  # ranks past the window they turned slow in
        self.hosts: list[str] | None = None
        self.last_gradient = LastGradient(model, self.clock)

    # The engine's step hooks (``engine/hooks.py``): a clock read each and plain stores, no other
    # call (``+=`` extends a list without one). A training micro-step is one span (data start,
    # forward start, backward start, last gradient, backward end), an optimizer step another
    # (``_STEP``, start, end). Data runs from the end of the engine's last call to the forward (an
    # evaluation forward in between counts as the script's time, as the loader's does); forward runs
    # to the backward's start, the loss included; optimizer from the backward's end to the step's,
    # the script's work between them (gradient clipping, say) included.

    def forward_begin(self) -> None:
        self._data_start, self._forward_start = self._last_end, self.clock.mark()

    def backward_begin(self, _loss: object, _boundary: bool) -> None:
        self._backward_start = self.clock.mark()
        self.last_gradient.in_backward, self.last_gradient.mark = True, None

    def backward_end(self, _boundary: bool) -> None:
        last_gradient = self.last_gradient
        last_gradient.in_backward = False
        if last_gradient.learning or last_gradient.mark is None:
            last_gradient.learnt()
        self._last_end = end = self.clock.mark()
        self._spans += (
            (self._data_start, self._forward_start, self._backward_start, last_gradient.mark, end),
        )

    def optimizer_end(self, notes: StepNotes) -> None:
        end = self.clock.mark()
        self._spans += ((_STEP, self._last_end, end),)
        self._last_end = end
        self._steps += 1
        notes.stragglers = None if self._steps % self.window else self._window_end(notes.step)

    def _window_end(self, step: int) -> dict[str, Any]:
        """At a window's end, on every rank alike: the ranks' breakdown (seconds per phase, summed
        over the window) and scores."""
        mine = torch.zeros(self.world_size, len(PHASES) + 2, dtype=torch.float64)
        mine[self.rank] = torch.tensor(self._resolve(), dtype=torch.float64)
        if self.hosts is None:
            self.hosts = self._hosts()  # a collective: every rank asks at the same window
        times = self._all_reduce_sum(mine)
        self._last_end = self.clock.mark()  # the all-reduce's wait for the slowest rank is no data wait
        rows: list[list[float]] = times.tolist()
        scores, logs = judge_window(rows)
        self._judge(step, self.rank, scores, logs, rows)
        per_phase = times[:, : len(PHASES)].mul(1000 / self.window).round(decimals=3).t().tolist()
        return {
            "window": self.window,
            "scores": scores,
            "ms_per_step": dict(zip(PHASES, per_phase, strict=True)),
        }

    def _resolve(self) -> list[float]:
        """This rank's row of the window: seconds per phase, steps, and the spread of its per-step
        work (the sum of squared deviations from its mean, kept as the steps come: Welford's)."""
        cuda, seconds = self.clock.cuda, self.clock.seconds
        totals = [0.0] * len(PHASES)
        steps, mean, deviations = 0, 0.0, 0.0
        own = 0.0
        for span in self._spans:
            if span[0] is _STEP:  # an optimizer step: the end of a step
                _, start, end = span
                taken = 0.0 if start is None else seconds(start, end) if cuda else end - start
                totals[_OPTIMIZER] += taken
                own += taken
                steps += 1
                delta = own - mean
                mean += delta / steps
                deviations += delta * (own - mean)
                own = 0.0
                continue
            data, forward, backward, last, end = span
            if last is not None:  # the rest of backward waited for the other ranks' gradients
                totals[_COMM] += seconds(last, end) if cuda else end - last
                end = last
            for phase, start, stop in (
                (_DATA, data, forward),
                (_FORWARD, forward, backward),
                (_BACKWARD, backward, end),
            ):
                if start is not None:  # no data mark before the first step
                    taken = seconds(start, stop) if cuda else stop - start
                    totals[phase] += taken
                    own += taken
        self._spans = []
        return [*totals, float(steps), deviations]

    def _judge(
        self, step: int, rank: int, scores: list[float], logs: list[Log], rows: list[list[float]]
    ) -> None:
        # the ranks share the machine and its episodes of load: its windows' spread is the ranks' mean
        machine = self._history.add(logs)
        for r, (log_ratio, within) in enumerate(logs):
            if scores[r] < self.factor:
                self._streaks[r] = (0, 0.0, 0.0)
                if r in self._onsets or r in self._warned:
                    self._warned.discard(r)
                    self._onsets.discard(r)
                continue
            if self._streaks[r][0] == 0 and self._history.windows > 1 and r not in self._onsets:
                # the window the rank turned slow in holds only part of its slow steps, wherever in
                # the window that happened (an episode of two windows' length touches three of
                # them): persistence counts the windows after it; a rank slow from the run's first
                # window on has no such window
                self._onsets.add(r)
                continue
            # a window's error: the larger of its steps' and of the run's windows' (load comes in
            # episodes longer than a step, which the steps of one window cannot show)
            variance = max(within, self._history.between(r), machine)
            windows, total, variances = self._streaks[r]
            windows, total, variances = windows + 1, total + log_ratio, variances + variance
            self._streaks[r] = (windows, total, variances)
            # the windows' mean log score, whose variance is the windows' over windows²
            bound = lower_bound(math.exp(total / windows), variances / windows**2)
            if windows < PERSISTENT_WINDOWS or bound < self.factor or r in self._warned or rank != 0:
                continue
            self._warned.add(r)
            assert self.hosts is not None
            per_step = {p: 1000 * rows[r][i] / self.window for i, p in enumerate(PHASES) if p != "comm"}
            log.warning(
                "straggler: rank %d on %s has taken %.2f× the other ranks' (median) time per step for the last %d "
                "steps (to step %d; at least %.2f× given how much its steps vary; data %.1f ms, forward %.1f ms, "
                "backward %.1f ms, optimizer %.1f ms); every rank waits for it at each all-reduce — check that "
                "host's load, GPU clocks and data loading, or give it a smaller share with sail.balance",
                r, self.hosts[r], math.exp(total / windows), windows * self.window, step, bound,
                per_step["data"], per_step["forward"], per_step["backward"], per_step["optimizer"],
            )  # fmt: skip

    def close(self) -> None:
        self.last_gradient.remove()


def judge_window(rows: Sequence[Sequence[float]]) -> tuple[list[float], list[Log]]:
    """Each rank's score (its work over the median of the other ranks'), and the score's log with
    that log's variance, from a window's all-reduced rows (phases, steps, deviations). A window of one
    step has no spread: its variance is 0, and the score is taken as it is."""
    work = [row[_DATA] + row[_FORWARD] + row[_BACKWARD] + row[_OPTIMIZER] for row in rows]
    spreads = [
        log_variance_of_mean(w, row[DEVIATIONS], row[STEPS]) for w, row in zip(work, rows, strict=True)
    ]
    scores: list[float] = []
    logs: list[Log] = []
    ranked = sorted(zip(work, spreads, range(len(work)), strict=True))
    for r, own in enumerate(work):
        others = [(w, v) for w, v, i in ranked if i != r]
        middle = others[(len(others) - 1) // 2 : len(others) // 2 + 1]  # one rank, or the two middle ones
        if len(middle) == 1:
            ((median, variance),) = middle
            median_variance = variance
        else:
            (low, low_variance), (high, high_variance) = middle
            median = (low + high) / 2
            # the variance of the two middle ones' average, as a share of it
            median_variance = (
                (low_variance * low * low + high_variance * high * high) / 4 / median**2
                if median > 0
                else 0.0
            )
        if median <= 0 or own <= 0:
            scores.append(1.0)
            logs.append((0.0, 0.0))
            continue
        scores.append(round(own / median, 3))
        logs.append((math.log(own / median), spreads[r] + median_variance))
    return scores, logs


class ScoreHistory:
    """Each rank's log scores over the last ``HISTORY_WINDOWS`` windows, and the variance of its
    score from one window to the next, from successive differences (half their mean square): a
    level that shifts once, as when a rank turns slow for good, adds one difference, where
    alternating episodes of load add one at every turn. The squares' sum is kept as the windows come
    (a few operations a window, no pass over the history)."""

    def __init__(self, world_size: int) -> None:
        self.scores = [deque[float](maxlen=HISTORY_WINDOWS) for _ in range(world_size)]
        self.windows = 0
        """How many windows the history holds (at most ``HISTORY_WINDOWS``)."""
        self._squares = [0.0] * world_size

    def add(self, logs: Sequence[Log]) -> float:
        """A window's log scores; returns the ranks' mean variance from window to window."""
        full, squares, total = self.windows == HISTORY_WINDOWS, self._squares, 0.0
        for r, (log_ratio, _) in enumerate(logs):
            history = self.scores[r]
            if self.windows:
                if full:  # the oldest difference leaves with the oldest score
                    squares[r] -= (history[1] - history[0]) ** 2
                squares[r] += (log_ratio - history[-1]) ** 2
                if squares[r] < 0:  # what rounding left of differences that all left
                    squares[r] = 0.0
                total += squares[r]
            history.append(log_ratio)
        if not full:
            self.windows += 1
        return total / (2 * (self.windows - 1)) / len(logs) if self.windows > 1 else 0.0

    def between(self, rank: int) -> float:
        return self._squares[rank] / (2 * (self.windows - 1)) if self.windows > 1 else 0.0
