"""Resuming on a different number of processes continues the same global sample order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import spikingsail
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.multiprocess
STEPS = 12  # 48 samples / global batch 8 = 6 steps per epoch: two epochs


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(
        torch.randn(48, 4, generator=g), torch.randint(0, 2, (48,), generator=g), torch.arange(48)
    )


def samples_per_step(checkpoints: str, stop_at: int | None, resume: bool) -> list[list[int]]:
    """The sample ids every optimizer step used, gathered over ranks (each rank returns all of them)."""
    torch.manual_seed(0)
    config = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "sail": {"seed": 5, "progress_bar": False}}  # fmt: skip
    engine, _ = spikingsail.initialize(model=torch.nn.Linear(4, 2), config=config, checkpoints_path=checkpoints,
                                       resume=resume)  # fmt: skip
    seen: list[list[int]] = []
    loader = engine.dataloader(dataset(), drop_last=True)
    while engine.global_steps < STEPS:
        for x, y, index in loader:
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
            mine = index.tolist()
            if dist.is_initialized():
                everyone: list[list[int]] = [[] for _ in range(engine.world_size)]
                dist.all_gather_object(everyone, mine)
                mine = sorted(i for part in everyone for i in part)
            seen.append(sorted(mine))
            if engine.global_steps in (stop_at, STEPS):
                break
        if engine.global_steps == stop_at:
            engine.save_checkpoint(checkpoints)
            break
    engine.close()
    return seen


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_global_sample_order_survives_a_world_size_change(tmp_path: Path, before: int, after: int) -> None:
    straight = run_ranks(samples_per_step, before, str(tmp_path / "straight"), None, False)[0]
    first = run_ranks(samples_per_step, before, str(tmp_path / "run"), 8, False)[0]
    second = run_ranks(samples_per_step, after, str(tmp_path / "run"), None, True)[0]
    assert len(straight) == STEPS
    assert first + second == straight
