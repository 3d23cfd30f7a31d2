"""How per-step work times become scores and warnings, on synthetic timings (the measurement itself:
tests/engine/test_stragglers.py). Timings are scripted step by step, as a shared machine gives them:
noise at every step, stalls, and episodes of load that slow one rank for a few windows."""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from spikingsail.engine.hooks import StepNotes
from spikingsail.engine.stragglers import (
    DEVIATIONS,
    HISTORY_WINDOWS,
    PERSISTENT_WINDOWS,
    PHASES,
    STEPS,
    ScoreHistory,
    StragglerWatch,
)
from spikingsail.engine.timing import spread

WINDOW = 20
Timing = Callable[[int, int], float]
"""(step, rank) -> the rank's work in that step, in seconds."""


def watch(
    world: int, window: int = WINDOW, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
) -> StragglerWatch:
    """Rank 0's watch, its clock stopped: only the scripted spans take time."""
    w = StragglerWatch(
        torch.nn.Linear(2, 2), torch.device("cpu"), rank=0, world_size=world, window=window, factor=1.25,
        all_reduce_sum=all_reduce_sum, hosts=lambda: [f"node{r}" for r in range(world)],
    )  # fmt: skip
    w.clock.mark = lambda: 0.0
    return w


def step(w: StragglerWatch, number: int, forward_seconds: float) -> dict[str, Any] | None:
    """One optimizer step of rank 0 whose forward took ``forward_seconds``, through the watch's hooks."""
    # data, forward, backward, last gradient, end: the forward's, up to the backward's start at the
    # clock's 0, as backward_end leaves it
    w._spans.append((None, -forward_seconds, 0.0, None, 0.0))
    w._last_end = 0.0
    notes = StepNotes(step=number)
    w.optimizer_end(notes)
    return notes.stragglers


def row(forward_ms: list[float], comm_ms: float = 0.0) -> torch.Tensor:
    """A rank's row of a window's all-reduce: its per-step forward times and a comm total."""
    out = torch.zeros(len(PHASES) + 2, dtype=torch.float64)
    out[PHASES.index("forward")] = sum(forward_ms) / 1000
    out[PHASES.index("comm")] = comm_ms / 1000
    out[STEPS] = len(forward_ms)
    out[DEVIATIONS] = spread([t / 1000 for t in forward_ms])[1]
    return out


def run(
    world: int, steps: int, timing: Timing, window: int = WINDOW
) -> tuple[list[dict[str, Any]], list[str]]:
    """``steps`` optimizer steps of rank 0's watch: its own work through its clock's spans, the other
    ranks' through the all-reduce. Returns the window reports and the warnings."""
    others: list[list[float]] = [[] for _ in range(world)]
    reports, warnings = [], []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("spikingsail.engine.stragglers")
    logger.addHandler(handler)

    def all_reduce_sum(mine: torch.Tensor) -> torch.Tensor:
        for r in range(1, world):
            mine[r] = row(others[r])
            others[r].clear()
        return mine

    w = watch(world, window, all_reduce_sum)
    try:
        for number in range(1, steps + 1):
            own = timing(number, 0)
            for r in range(1, world):
                others[r].append(1000 * timing(number, r))
            report = step(w, number, own)
            if report is not None:
                reports.append(report)
    finally:
        logger.removeHandler(handler)
    return reports, warnings


def machine(
    seed: int, world: int, slow: dict[int, float] | None = None, *, quiet: bool = False, episodes: bool = True
) -> Timing:
    """Step times of 30 ms: on a shared machine (the default) ±25% (log-normal) at every step, a
    stall of 3× at 3% of steps and (``episodes``) load that slows one rank at a time by 1.3–1.8× for
    half a window to two windows, two windows apart on the same rank — as a balanced run on this busy
    2-core machine measured (1.4–1.8× on one rank for up to three windows, 2.4× once, then on the
    other), from the fourth window on (a run that begins with a rank slowed for three windows is a
    straggler as far as its first windows can tell); ``quiet``: ±10% and nothing else. ``slow``: ranks slower at every step, by that factor."""
    rng = random.Random(seed)
    slowdowns: dict[tuple[int, int], float] = {}
    free = [0] * world  # the step from which a rank may take its next episode
    step = PERSISTENT_WINDOWS * WINDOW
    while episodes and not quiet and step < 10_000:
        step += rng.randrange(0, 2 * WINDOW)
        length, rank, factor = (
            rng.randrange(WINDOW // 2, 2 * WINDOW + 1),
            rng.randrange(world),
            rng.uniform(1.3, 1.8),
        )
        if step < free[rank]:
            continue
        slowdowns.update({(s, rank): factor for s in range(step, step + length)})
        step += length
        free[rank] = step + 2 * WINDOW
    base = slow or {}

    def timing(step: int, rank: int) -> float:
        noise = rng.lognormvariate(0, 0.10 if quiet else 0.25)
        stall = 3.0 if not quiet and rng.random() < 0.03 else 1.0
        return 0.030 * noise * stall * slowdowns.get((step, rank), 1.0) * base.get(rank, 1.0)

    return timing


def test_scores_are_work_over_the_other_ranks_median_and_comm_is_not_work() -> None:
    totals = torch.stack([row([10.0], 30.0), row([10.0], 30.0), row([20.0]), row([12.0], 25.0)])
    w = watch(4, window=1, all_reduce_sum=lambda _mine: totals)
    report = step(w, 1, 0.010)
    assert report is not None
    assert report["scores"] == [0.833, 0.833, 2.0, 1.2]
    assert report["ms_per_step"]["comm"] == [30.0, 30.0, 0.0, 25.0]


def test_a_slow_rank_is_named_once_and_again_after_it_recovered() -> None:
    # rank 1 at 3× in the windows marked 3, even in those marked 1, on a quiet machine
    pattern = [3, 3, 3, 3, 1, 1, 3, 3, 3, 3, 3, 3]
    timing = machine(0, 2, quiet=True)
    _, warnings = run(
        2, len(pattern) * WINDOW, lambda s, r: timing(s, r) * (pattern[(s - 1) // WINDOW] if r else 1)
    )
    assert len(warnings) == 2, warnings  # once, not every window; again after the recovery
    assert all(w.startswith("straggler: rank 1 on node1 has taken ") for w in warnings), warnings
    # slow from the first window: named at the third; slow again from the seventh, the window it
    # turned slow in, which persistence does not count: named at the third window after it
    assert f"(to step {3 * WINDOW};" in warnings[0] and f"(to step {10 * WINDOW};" in warnings[1]


def test_an_episode_of_two_windows_across_three_raises_no_alarm() -> None:
    # one rank 2.5x slower for 40 steps from the middle of the fourth window on a quiet machine (the
    # real-process test measured 1.5x, 2.3x, 1.6x): 10, 20 and 10 slow steps in three windows, each
    # window's score at or above the factor and the three together significant (named in 20 of 20
    # seeds when persistence counted the window the episode began in)
    timing = machine(0, 2, quiet=True)
    first = 3 * WINDOW + WINDOW // 2 + 1
    _, warnings = run(
        2, 10 * WINDOW, lambda s, r: timing(s, r) * (2.5 if r == 0 and first <= s < first + 2 * WINDOW else 1)
    )
    assert warnings == []


def test_a_window_of_one_step_takes_the_windows_spread() -> None:
    # one step a window has no spread of its own: the windows' spread from one to the next is the
    # error, so a rank steadily 2× slower is named at the third window, and one that is 2× slower
    # only every other window is not
    _, warnings = run(2, 3, lambda step, rank: 0.010 * (2 if rank else 1), window=1)
    assert len(warnings) == 1 and "(to step 3;" in warnings[0], warnings
    assert run(2, 40, lambda step, rank: 0.010 * (2 if rank and step % 2 else 1), window=1)[1] == []


@pytest.mark.parametrize("world", [2, 3])
def test_noisy_balanced_ranks_never_raise_the_alarm(world: int) -> None:
    # 200 runs of 60 windows each with episodes of load that put one rank up to 1.8× above the
    # others for up to two windows (a fixed ratio over three windows warned in most of these runs)
    for seed in range(200):
        _, warnings = run(world, 60 * WINDOW, machine(seed, world))
        assert warnings == [], (seed, warnings)


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_slow_at_every_step_is_named_within_a_bounded_number_of_windows(world: int) -> None:
    # 1.5× at every step: at the third window on a quiet machine; within 30 on a shared one, whose
    # noisy steps (stalls of 3×) take more windows to tell 1.5× from the factor of 1.25
    for seed in range(50):
        _, warnings = run(world, 3 * WINDOW, machine(seed, world, {1: 1.5}, quiet=True))
        assert len(warnings) == 1 and warnings[0].startswith("straggler: rank 1 on node1 "), (seed, warnings)
        assert f"(to step {PERSISTENT_WINDOWS * WINDOW};" in warnings[0]
        _, warnings = run(world, 30 * WINDOW, machine(seed, world, {1: 1.5}, episodes=False))
        assert warnings and all(w.startswith("straggler: rank 1 on node1 ") for w in warnings), (
            seed,
            warnings,
        )


@given(st.lists(st.lists(st.floats(-3, 3), min_size=2, max_size=2), max_size=3 * HISTORY_WINDOWS))
def test_the_kept_window_to_window_variance_is_half_the_mean_square_of_successive_differences(
    windows: list[list[float]],
) -> None:
    """What ``ScoreHistory`` keeps as the windows come equals the sum over the last
    ``HISTORY_WINDOWS`` scores, for each rank and for the ranks' mean."""
    history = ScoreHistory(2)
    for n, scores in enumerate(windows, start=1):
        machine = history.add([(score, 0.0) for score in scores])
        last = windows[max(0, n - HISTORY_WINDOWS) : n]
        expected = [
            math.fsum((b[r] - a[r]) ** 2 for a, b in itertools.pairwise(last)) / (2 * (len(last) - 1))
            if len(last) > 1
            else 0.0
            for r in range(2)
        ]
        assert history.windows == len(last)
        assert [history.between(r) for r in range(2)] == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert machine == pytest.approx(sum(expected) / 2, rel=1e-9, abs=1e-12)
