"""``auto``'s choice of split, step by step, on ranks whose time per step is scripted: a fixed cost per
step plus a cost per sample, so that a rank's speed per sample depends on its share (as the engine's
per-step work, the data loader and cache effects make it on real devices). The split must converge on
even times, probe its neighbours by the steps' wall time, then hold still."""

from __future__ import annotations

import torch

from spikingsail.engine.balance import DRIFT_STEPS, MEASURE_STEPS, REFINE_WINDOWS, WARMUP_STEPS, Balancer
from spikingsail.engine.split_search import PROBE_FRACTION, PROBE_MARGIN, PROBE_ROUNDS, PROBE_STEPS

GLOBAL = 2048
FIXED = (0.05, 0.02)
"""Seconds per step spent whatever the share: rank 0's engine and loader work is the larger here."""
PER_SAMPLE = (1 / 8000, 1 / 2800)
"""Seconds per sample: rank 1 computes about 2.9 times slower."""


Costs = tuple[tuple[float, float], tuple[float, float]]
"""(fixed seconds per step, seconds per sample) of rank 0 and of rank 1."""
COSTS: Costs = ((FIXED[0], PER_SAMPLE[0]), (FIXED[1], PER_SAMPLE[1]))


class ScriptedTimer:
    """Stands in for ``ComputeTimer``: rank 0's compute time for its current share, and the step's
    wall time, the slower rank's compute (the other waits for it in the all-reduce)."""

    def __init__(self, balancer: Balancer, costs: Costs, bias: float, offset: float = 0.0) -> None:
        self.balancer = balancer
        self.costs = costs
        self.bias = bias
        self.offset = offset

    def take(self) -> tuple[float, int, float]:
        share = self.balancer.split[0]
        return times(self.balancer.split, self.costs)[0], share, self.wall()

    def wall(self) -> float:
        return max(times(self.balancer.split, self.costs))

    def measured(self) -> float:
        """Rank 1's compute time as its timer reports it: ``bias`` times what it costs the step,
        plus ``offset`` seconds."""
        return times(self.balancer.split, self.costs)[1] * self.bias + self.offset

    def restart(self) -> None:
        pass


def times(split: list[int], costs: Costs = COSTS) -> list[float]:
    return [costs[r][0] + costs[r][1] * split[r] for r in range(2)]


def run(
    steps: int,
    costs: Costs = COSTS,
    drift: float = 0.0,
    bias: float = 1.0,
    change_at: int = 0,
    walls: list[float] | None = None,
    offset: float = 0.0,
    burst: tuple[int, float] = (0, 0.0),
) -> Balancer:
    """``steps`` optimizer steps at ``costs``; with ``drift``, rank 1's cost per sample grows by that
        fraction from step ``DRIFT_STEP`` on (the split and its probe are done by then); with
        ``change_at``, it halves from that step on. ``bias``: rank 1's timer overstates its compute by
        that factor, plus ``offset`` seconds a step. ``burst``: (steps, fraction): rank 1's cost per
    sample grows by that fraction for that many steps from ``DRIFT_STEP`` on, then returns. ``walls``
    gets every step's wall time."""
    balancer = Balancer(global_micro_batch=GLOBAL, world_size=2, weights=None, rebalance_factor=1.25)
    timer = ScriptedTimer(balancer, costs, bias, offset)
    balancer.timer = timer  # type: ignore[assignment]

    def all_reduce_sum(mine: torch.Tensor) -> torch.Tensor:
        mine[1] = torch.tensor([timer.measured(), balancer.split[1], wall], dtype=torch.float64)
        return mine

    for step in range(1, steps + 1):
        if drift and step == DRIFT_STEP:
            timer.costs = (costs[0], (costs[1][0], costs[1][1] * (1 + drift)))
        if burst[0] and step in (DRIFT_STEP, DRIFT_STEP + burst[0]):
            factor = 1 + burst[1] if step == DRIFT_STEP else 1.0
            timer.costs = (costs[0], (costs[1][0], costs[1][1] * factor))
        if change_at and step == change_at:
            timer.costs = (costs[0], (costs[1][0], costs[1][1] / 2))
        wall = timer.wall()  # the step that ends here ran at the split of its start
        if walls is not None:
            walls.append(wall)
        balancer.after_step(step, all_reduce_sum, rank=0)
    return balancer


FIRST = WARMUP_STEPS + MEASURE_STEPS
"""The step of the first split."""
COMPARISON = 2 * PROBE_ROUNDS * PROBE_STEPS
"""Steps one comparison of a split with a neighbour takes."""
SETTLED = FIRST + REFINE_WINDOWS * MEASURE_STEPS
"""By this step a refinement window has found the split even (with ``COSTS``: one refinement, then
one window that finds it even), and the probe begins."""
PROBED = SETTLED + 2 * COMPARISON
"""By this step the probe of an even split has tried both neighbours and kept neither."""
DRIFT_STEP = PROBED + 1


def test_auto_converges_on_even_times_within_the_refinement_windows() -> None:
    balancer = run(FIRST)
    (change,) = balancer.changes
    slow, fast = times(change["split"])[1], times(change["split"])[0]
    assert slow / fast > 1.03, "the first split, from speeds at equal shares, leaves the ranks uneven"
    balancer = run(FIRST + 2 * MEASURE_STEPS)
    refined = [c for c in balancer.changes if c["refined"]]
    assert refined and all(c["step"] <= FIRST + 2 * MEASURE_STEPS for c in refined), balancer.changes
    even = balancer.changes[-1]["split"]
    final = times(even)
    assert max(final) / min(final) < 1.02, (even, final)
    # the probe tries both neighbours of the even split, finds each one's steps slower (the step
    # waits for the slower rank), keeps neither and returns to it; then the split holds still
    walls: list[float] = []
    later = run(PROBED + 10 * MEASURE_STEPS, walls=walls)
    assert later.changes == balancer.changes and later.split == even, later.changes
    probed = walls[SETTLED:PROBED]
    assert sum(w > max(final) for w in probed) == COMPARISON, "each neighbour ran for half of its comparison"
    assert walls[PROBED:] == [max(final)] * (len(walls) - PROBED)


def test_a_slow_ranks_small_share_is_refined_by_the_time_it_costs_not_by_the_samples_it_moves() -> None:
    # rank 1 is 2.6 times slower and has a fixed cost per step: the first split leaves it almost 4%
    # slower than rank 0, which an even split fixes by moving 15 samples (under 1% of the global
    # micro-batch, but 3% of rank 1's share)
    costs: Costs = ((0.0, 1 / 10000), (0.012, 1 / 3800))
    (change,) = run(FIRST, costs).changes
    slow, fast = times(change["split"], costs)[1], times(change["split"], costs)[0]
    assert slow / fast > 1.03, change
    balancer = run(FIRST + 3 * MEASURE_STEPS, costs)
    (refined,) = [c for c in balancer.changes if c["refined"]]
    moved = abs(refined["split"][1] - change["split"][1])
    assert 0 < moved < 0.01 * GLOBAL, (change, refined)
    final = times(refined["split"], costs)
    assert max(final) / min(final) < 1.01, (refined["split"], final)
    later = run(PROBED + 10 * MEASURE_STEPS, costs)
    assert later.changes == balancer.changes and later.split == refined["split"], later.changes


def test_a_slow_drift_below_the_factor_is_followed_and_a_small_one_is_not() -> None:
    before = run(DRIFT_STEP - 1)
    assert before._probe is None and not before._probe_due, "the probe is over before the drift"
    # rank 1 20% slower per sample (its share of the speed moves by less than the factor of 1.25):
    # within a window and DRIFT_STEPS more steps, a new split that evens the times again
    after = run(DRIFT_STEP - 1 + 2 * MEASURE_STEPS, drift=0.20)
    new = [c for c in after.changes if c["step"] >= DRIFT_STEP]
    assert new and new[0]["step"] < DRIFT_STEP + MEASURE_STEPS + DRIFT_STEPS, after.changes
    assert new[0]["split"][1] < before.split[1]
    final = times(new[-1]["split"], ((COSTS[0]), (COSTS[1][0], COSTS[1][1] * 1.20)))
    assert max(final) / min(final) < 1.05, (new[-1]["split"], final)
    # 6% slower: within the noise of an 8-step window on a shared machine, the split holds still
    assert run(DRIFT_STEP - 1 + 4 * MEASURE_STEPS, drift=0.06).changes == before.changes
    # 50% slower for 4 steps (a burst of load): windows over them find rank 1 far slower than even,
    # but not for DRIFT_STEPS steps in a row, and the split holds still
    assert run(DRIFT_STEP - 1 + 4 * MEASURE_STEPS, burst=(4, 0.5)).changes == before.changes


def test_a_neighbour_whose_steps_run_faster_is_kept_and_the_later_checks_take_it_as_even() -> None:
    # rank 1 computes half as fast, and its timer overstates its compute by 30% (say its side of the
    # all-reduce counts as compute): even measured times leave it too small a share, and every step
    # waits for rank 0. One probe move (8% of rank 1's share) saves about 3% of a step.
    costs: Costs = ((0.0, 1 / 4000), (0.0, 1 / 2000))
    walls: list[float] = []
    balancer = run(PROBED + 4 * COMPARISON, costs, bias=1.3, walls=walls)
    measured_even = [c for c in balancer.changes if not c.get("probed")][-1]["split"]
    (probed,) = [c for c in balancer.changes if c.get("probed")]
    assert probed["split"][1] > measured_even[1], (measured_even, probed)

    def wall(split: list[int]) -> float:
        return max(times(split, costs))

    assert wall(probed["split"]) < wall(measured_even) * (1 - 2 * PROBE_MARGIN), (measured_even, probed)
    # the best on the probe's grid: one more move either way would run slower
    delta = round(PROBE_FRACTION * probed["split"][1])
    for move in (-delta, delta):
        neighbour = [probed["split"][0] - move, probed["split"][1] + move]
        assert wall(neighbour) > wall(probed["split"]), (probed["split"], neighbour)
    # the first comparison (rank 1 gives samples away) kept nothing, the next ones kept theirs
    assert probed["step"] > SETTLED + 2 * COMPARISON, balancer.changes
    # what the probe found holds: the drift check does not take the split back to even measured times
    assert balancer.changes[-1] is probed and balancer.split == probed["split"]
    assert walls[-1] == wall(probed["split"])


def test_a_change_by_the_factor_in_the_middle_of_a_probe_splits_again_within_a_turn() -> None:
    change_at = SETTLED + PROBE_STEPS + 1
    balancer = run(change_at + 2 * PROBE_STEPS, change_at=change_at)
    (new,) = [c for c in balancer.changes if c["step"] >= change_at]
    assert new["step"] < change_at + PROBE_STEPS and not new["refined"], balancer.changes
    assert new["split"][1] > balancer.changes[0]["split"][1], "rank 1, twice as fast, takes more"


def test_probes_continue_past_their_moves_while_the_steps_run_faster_and_then_hold() -> None:
    # rank 1's timer reports half its compute (say a slow device's time hidden in an asynchronous
    # queue): even measured times give it far too large a share, every step waits for it, and one
    # probe's moves do not reach the best split. The next probe starts from there after a window,
    # until a probe keeps fewer moves than it may: the steps end within 1% of the best split's time.
    costs: Costs = ((0.0, 1 / 10000), (0.012, 1 / 3800))
    walls: list[float] = []
    balancer = run(PROBED + 16 * COMPARISON, costs, bias=0.5, walls=walls)
    probed = [c for c in balancer.changes if c.get("probed")]
    assert len(probed) >= 2, balancer.changes
    best = min(max(times([GLOBAL - n, n], costs)) for n in range(1, GLOBAL))
    first_measured = max(times(balancer.changes[0]["split"], costs))
    assert first_measured > best * 1.2, "the timers' split is far from the best"
    assert walls[-1] < best * 1.01, (balancer.split, walls[-1], best)
    assert balancer.settled and balancer.changes[-1]["step"] < PROBED + 12 * COMPARISON, balancer.changes
    # the drift check takes each probed split as even: no measured change between the probes
    assert all(c.get("probed") for c in balancer.changes[1:]), balancer.changes


def test_a_probed_split_is_even_for_the_drift_check_even_where_the_timers_barely_see_the_share() -> None:
    # rank 1's timer reports a fixed 0.1 s a step and only 30% of its compute: what it reports
    # hardly changes with its share. The probes find the best split by the steps' time; the speeds
    # measured at each kept split become the drift check's even ones, so no measured change moves
    # the split between or after the probes.
    walls: list[float] = []
    balancer = run(PROBED + 16 * COMPARISON, bias=0.3, offset=0.1, walls=walls)
    after = [c for c in balancer.changes if c["step"] > SETTLED]
    assert after and all(c.get("probed") for c in after), balancer.changes
    best = min(max(times([GLOBAL - n, n])) for n in range(1, GLOBAL))
    assert walls[-1] < best * 1.01, (balancer.split, walls[-1], best)
    assert balancer.settled
