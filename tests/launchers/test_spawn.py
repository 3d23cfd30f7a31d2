"""spikingsail.spawn: N real processes, ranks found by the engine, failures reported by rank."""

from __future__ import annotations

import sys

import pytest
import torch

import spikingsail

pytestmark = pytest.mark.multiprocess


def train_a_little(scale: float) -> tuple[int, int, list[float]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "sail": {"progress_bar": False},
    }
    engine, _ = spikingsail.initialize(model=model, config=config)
    x = torch.full((2, 3), float(engine.rank + 1) * scale)
    engine.backward(engine(x).sum())
    engine.step()
    weights = engine.module.weight.detach().flatten().tolist()
    info = (engine.rank, engine.world_size, weights)
    engine.close()
    return info


def fail_on_rank_one() -> None:
    import os

    if os.environ["RANK"] == "1":
        sys.exit(3)


def test_spawn_runs_ranks_that_train_together() -> None:
    results = spikingsail.spawn(train_a_little, 2, args=(0.5,))
    assert [(r[0], r[1]) for r in results] == [(0, 2), (1, 2)]
    assert results[0][2] == results[1][2]  # gradients were averaged across the two ranks


def test_spawn_failure_names_the_rank() -> None:
    with pytest.raises(spikingsail.LaunchError, match=r"spawn: rank 1 of 2 failed"):
        spikingsail.spawn(fail_on_rank_one, 2)
