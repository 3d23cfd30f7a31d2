"""``auto``'s choice of split, step by step, on ranks whose time per step is scripted: a fixed cost per
step plus a cost per sample, so that a rank's speed per sample depends on its share (as the engine's
per-step work, the data loader and cache effects make it on real devices). The split must converge on
even times, then hold still."""

from __future__ import annotations

import torch

from spikingsail.engine.balance import MEASURE_STEPS, WARMUP_STEPS, Balancer

GLOBAL = 2048
FIXED = (0.05, 0.02)
"""Seconds per step spent whatever the share: rank 0's engine and loader work is the larger here."""
PER_SAMPLE = (1 / 8000, 1 / 2800)
"""Seconds per sample: rank 1 computes about 2.9 times slower."""


class ScriptedTimer:
    """Stands in for ``ComputeTimer``: rank 0's compute time for its current share."""

    def __init__(self, balancer: Balancer) -> None:
        self.balancer = balancer

    def take(self) -> tuple[float, int]:
        share = self.balancer.split[0]
        return FIXED[0] + PER_SAMPLE[0] * share, share

    def restart(self) -> None:
        pass


def times(split: list[int]) -> list[float]:
    return [FIXED[r] + PER_SAMPLE[r] * split[r] for r in range(2)]


def run(steps: int) -> Balancer:
    balancer = Balancer(global_micro_batch=GLOBAL, world_size=2, weights=None, rebalance_factor=1.25)
    balancer.timer = ScriptedTimer(balancer)  # type: ignore[assignment]

    def all_reduce_sum(mine: torch.Tensor) -> torch.Tensor:
        other = balancer.split[1]
        mine[1] = torch.tensor([FIXED[1] + PER_SAMPLE[1] * other, other], dtype=torch.float64)
        return mine

    for step in range(1, steps + 1):
        balancer.after_step(step, all_reduce_sum, rank=0)
    return balancer


def test_auto_converges_on_even_times_within_the_refinement_windows() -> None:
    first = WARMUP_STEPS + MEASURE_STEPS
    balancer = run(first)
    (change,) = balancer.changes
    slow, fast = times(change["split"])[1], times(change["split"])[0]
    assert slow / fast > 1.03, "the first split, from speeds at equal shares, leaves the ranks uneven"
    balancer = run(first + 3 * MEASURE_STEPS)
    refined = [c for c in balancer.changes if c["refined"]]
    assert refined and all(c["step"] <= first + 2 * MEASURE_STEPS for c in refined), balancer.changes
    final = times(balancer.split)
    assert max(final) / min(final) < 1.02, (balancer.split, final)
    # once even, the split holds still: no change after the refinement windows
    assert balancer.changes == run(first + 10 * MEASURE_STEPS).changes
