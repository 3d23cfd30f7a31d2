"""How window totals become scores and warnings (the measurement itself: tests/engine/test_stragglers.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from spikingsail.engine.stragglers import PHASES, StragglerWatch


def watch(world: int) -> StragglerWatch:
    return StragglerWatch(torch.nn.Linear(2, 2), torch.device("cpu"), world_size=world, window=1, factor=1.25)


def window(w: StragglerWatch, step: int, forward_ms: list[float], comm_ms: list[float]) -> dict:
    totals = torch.zeros(len(forward_ms), len(PHASES), dtype=torch.float64)
    totals[:, PHASES.index("forward")] = torch.tensor(forward_ms) / 1000
    totals[:, PHASES.index("comm")] = torch.tensor(comm_ms) / 1000
    report = w.after_step(step, 0, lambda _mine: totals, lambda: [f"node{r}" for r in range(len(forward_ms))])
    assert report is not None
    return report


def test_scores_are_work_over_the_other_ranks_median_and_comm_is_not_work(
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = watch(4)
    report = window(w, 1, [10, 10, 20, 12], [30, 30, 0, 25])
    assert report["scores"] == [0.833, 0.833, 2.0, 1.2]
    assert report["ms_per_step"]["comm"] == [30.0, 30.0, 0.0, 25.0]


def test_a_rank_slow_for_three_windows_is_named_once_and_again_after_it_recovered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = watch(2)
    caplog.set_level(logging.WARNING, "spikingsail.engine.stragglers")
    slow, even = [10.0, 20.0], [10.0, 10.5]
    for step, forward in enumerate([slow, slow, even, slow, slow, slow, slow, even, slow, slow, slow], 1):
        window(w, step, forward, [10.0, 0.0])
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # at step 6 and, after the recovery at step 8, at step 11
    assert warnings[0].startswith("straggler: rank 1 on node1 has taken 2.00× ")
    assert "(to step 6;" in warnings[0] and "(to step 11;" in warnings[1]
