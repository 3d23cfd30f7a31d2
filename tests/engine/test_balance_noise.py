"""``auto``'s split under noisy step times, step by step (pure logic; the noise-free scripted costs:
tests/engine/test_balance_split.py). Each rank's compute per step is a fixed cost plus a cost per
sample, times log-normal noise at every step; a rank under a CPU quota gets ``QUOTA`` of a core in
10 ms periods, so its step takes as many periods as its compute needs, from a random phase: what
``auto`` saw on a 2-core machine with one of two ranks under a 40% quota and 64 samples a step (its
measured speed swung 223–579 samples/s, the split between [61, 3], [58, 6] and [55, 9])."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from spikingsail.data.sampler import split_batch
from spikingsail.engine.balance import MEASURE_STEPS, REBASE_STEPS, WARMUP_STEPS, Balancer
from spikingsail.engine.timing import SpeedMeasure, Step, cuts

PERIOD = 0.010
QUOTA = 0.4
FIRST = WARMUP_STEPS + MEASURE_STEPS


@dataclass
class Rank:
    fixed: float
    """Seconds of compute per step whatever the share."""
    per_sample: float
    noise: float
    """The log-normal noise's sigma, at every step."""
    quota: float = 1.0

    def seconds(self, share: int, rng: random.Random) -> float:
        compute = (self.fixed + self.per_sample * share) * rng.lognormvariate(0, self.noise)
        if self.quota >= 1:
            return compute
        # runs for quota × PERIOD of each period, from a random phase of the first
        budget = self.quota * PERIOD
        phase = rng.uniform(0, budget)
        periods = math.floor((compute + phase) / budget)
        return compute + periods * (PERIOD - budget)


@dataclass
class Stalling(Rank):
    """A rank that stalls for ``stall`` seconds at every ``every``-th step (a loader refilling)."""

    every: int = MEASURE_STEPS
    stall: float = 0.0
    steps: int = 0

    def seconds(self, share: int, rng: random.Random) -> float:
        self.steps += 1
        return super().seconds(share, rng) + (self.stall if self.steps % self.every == 0 else 0.0)


def expected(ranks: list[Rank], split: list[int], draws: int = 400) -> float:
    """A step's mean time at ``split``: the slowest rank's (the others wait for it)."""
    rng = random.Random(1)
    return (
        sum(max(r.seconds(n, rng) for r, n in zip(ranks, split, strict=True)) for _ in range(draws)) / draws
    )


class NoisyTimer:
    """Stands in for ``ComputeTimer`` on rank 0; the all-reduce fills in rank 1's row."""

    def __init__(self, balancer: Balancer, ranks: list[Rank], seed: int) -> None:
        self.balancer, self.ranks, self.rng = balancer, ranks, random.Random(seed)
        self.step: list[float] = []

    def draw(self) -> None:
        self.step = [r.seconds(n, self.rng) for r, n in zip(self.ranks, self.balancer.split, strict=True)]

    def take(self) -> tuple[float, int, float]:
        return self.step[0], self.balancer.split[0], max(self.step)

    def restart(self) -> None:
        pass


def run(
    ranks: list[Rank], steps: int, seed: int, total: int = 64, change: tuple[int, Rank] | None = None
) -> tuple[Balancer, list[list[int]]]:
    """``steps`` steps; ``change``: (step, rank 1's costs from that step on)."""
    balancer = Balancer(global_micro_batch=total, world_size=2, weights=None, rebalance_factor=1.25)
    timer = NoisyTimer(balancer, ranks, seed)
    balancer.timer = timer  # type: ignore[assignment]

    def all_reduce_sum(mine: torch.Tensor) -> torch.Tensor:
        mine[1] = torch.tensor([timer.step[1], split[1], max(timer.step)], dtype=torch.float64)
        return mine

    splits = []
    for step in range(1, steps + 1):
        if change is not None and step == change[0]:
            timer.ranks = [ranks[0], change[1]]
        split = list(balancer.split)  # the split this step ran at
        timer.draw()
        balancer.after_step(step, all_reduce_sum, rank=0)
        splits.append(list(balancer.split))
    return balancer, splits


QUOTA_CASE = [Rank(0.001, 0.00025, 0.15), Rank(0.004, 0.00025, 0.15, quota=QUOTA)]
"""Rank 1 under the quota: 3 samples take it 11–17 ms, 9 take 15 ms, 32 take 30 ms; rank 0 takes 9 ms
for 32 (speeds, samples/s, that depend on the share: the proportional split is unstable there)."""
LINEAR_CASE = [Rank(0.0, 1 / 2000, 0.30), Rank(0.0, 1 / 1000, 0.30)]
"""Rank 1 half as fast, every step ±30%: the even split is about [43, 21]."""


def test_under_a_cpu_quota_the_split_settles_and_runs_faster_than_equal_shares() -> None:
    equal = expected(QUOTA_CASE, [32, 32])
    for seed in range(20):
        balancer, splits = run(QUOTA_CASE, 200, seed)
        # not a re-split every 8–30 steps, back and forth: a few, each further the same way
        assert len([c for c in balancer.changes if c["step"] > 100]) <= 2, (seed, balancer.changes)
        shares = [c["split"][1] for c in balancer.changes]
        assert shares == sorted(shares, reverse=True), (seed, balancer.changes)
        mean = sum(expected(QUOTA_CASE, s, 50) for s in splits) / len(splits)
        assert mean < 0.8 * equal, (seed, mean, equal, balancer.changes)
        assert expected(QUOTA_CASE, balancer.split) < 0.8 * equal, (seed, balancer.changes)


def test_noisy_speeds_give_a_split_that_settles_near_even_and_holds_still() -> None:
    # at ±30% a step, an 8-step window's speeds are ±10% off by themselves, which must not move the
    # split back and forth; the steps at one split, together, tell more
    best = expected(LINEAR_CASE, [43, 21])
    for seed in range(20):
        balancer, _ = run(LINEAR_CASE, 400, seed)
        assert len([c for c in balancer.changes if c["step"] > 150]) <= 1, (seed, balancer.changes)
        assert expected(LINEAR_CASE, balancer.split) <= best * 1.12, (seed, balancer.split, balancer.changes)


def test_a_noisy_first_measurement_moves_the_split_less_than_its_speeds_say() -> None:
    # the first split from 8 noisy steps lies between equal shares and the one the measured speeds
    # give: one standard error of each speed nearer to equal
    for seed in range(20):
        balancer, _ = run(LINEAR_CASE, FIRST, seed)
        (change,) = balancer.changes
        raw = split_batch(64, change["speeds"])
        assert 32 > change["split"][1] > raw[1], (seed, change, raw)
    # without noise, the speeds' own split
    exact = [Rank(0.0, 1 / 2000, 0.0), Rank(0.0, 1 / 1000, 0.0)]
    assert run(exact, FIRST, 0)[0].changes[0]["split"] == [43, 21]


def test_a_rank_that_speeds_up_inside_the_first_window_at_a_new_split_is_followed() -> None:
    # rank 1 3.5× slower, split at step 9; at step 15, inside the window that would become the new
    # split's reference, its quota is lifted: that window is no reference, and a split follows
    slow, fast = Rank(0.002, 1 / 4500, 0.15), Rank(0.002, 1 / 19000, 0.15)
    for seed in range(20):
        balancer, _ = run([Rank(0.002, 1 / 16000, 0.15), slow], 30, seed, total=512, change=(15, fast))
        first, *later = balancer.changes
        assert first["step"] == FIRST and later and later[0]["step"] <= 24, (seed, balancer.changes)
        assert later[0]["split"][1] > 1.5 * first["split"][1], (seed, balancer.changes)


def test_a_rank_that_stalls_every_window_does_not_hold_the_first_split_in_its_rebase() -> None:
    # rank 1 half as fast and stalling once every 8 steps: every window's halves differ by the
    # stall, never surely; the window slides for at most REBASE_STEPS, then becomes the reference,
    # and auto goes on to refine and probe (without the bound it slid on forever: one split, never
    # settled, whatever the stalls cost)
    for seed in range(20):
        ranks = [Rank(0.0, 1 / 2000, 0.05), Stalling(0.0, 1 / 1000, 0.05, stall=0.06)]
        balancer, _ = run(ranks, FIRST + REBASE_STEPS + 120, seed)
        assert balancer.settled or len(balancer.changes) > 1, (seed, balancer.changes)


STEP_ROWS = st.lists(st.tuples(*[st.floats(1e-3, 1.0), st.integers(1, 512)] * 2), min_size=0, max_size=30)


@given(STEP_ROWS, st.integers(1, 8))
@example(rows=[(1.0, 1, 0.75, 1), (1.0, 1, 0.001, 1), (1.0, 1, 0.001, 1)], least=1)  # 0.75² among 0.001²
def test_cuts_measure_each_side_as_its_own_steps_would(rows: list[tuple[float, ...]], least: int) -> None:
    steps: list[Step] = [[[c0, float(n0), c0], [c1, float(n1), c1]] for c0, n0, c1, n1 in rows]
    found = list(cuts(steps, least))
    places = range(least, len(steps) - least + 1)
    assert len(found) == len(places)
    for (before, after), cut in zip(found, places, strict=True):
        for got, want in (
            (before, SpeedMeasure.of_steps(steps[:cut])),
            (after, SpeedMeasure.of_steps(steps[cut:])),
        ):
            assert got.speeds == pytest.approx(want.speeds, rel=1e-9)
            assert got.variances == pytest.approx(want.variances, rel=1e-6, abs=1e-12)
