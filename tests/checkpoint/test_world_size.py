"""Resuming on a different number of processes continues the same global sample order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def every_ranks(engine: spikingsail.Engine, mine: list[int]) -> list[int]:
    """The sample ids of this micro-step on every rank, rank by rank."""
    if not dist.is_initialized():
        return mine
    everyone: list[list[int]] = [[] for _ in range(engine.world_size)]
    dist.all_gather_object(everyone, mine)
    return [i for part in everyone for i in part]


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
            seen.append(sorted(every_ranks(engine, index.tolist())))
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


def steps_and_weights(checkpoints: str, stop_at: int | None, resume: bool) -> dict[str, Any]:
    """micro 8 per process at train_batch_size 16: 2 processes × accumulation 1, or 1 × accumulation 2.
    Returns the sample ids of every optimizer step (over ranks and micro-steps) and the final weights."""
    torch.manual_seed(0)
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
              "sail": {"seed": 5, "progress_bar": False}}  # fmt: skip
    engine, _ = spikingsail.initialize(model=torch.nn.Linear(4, 2), config=config, checkpoints_path=checkpoints,
                                       resume=resume)  # fmt: skip
    steps: list[list[int]] = []
    window: list[int] = []
    loader = engine.dataloader(dataset(), drop_last=True)
    while engine.global_steps < STEPS and engine.global_steps != stop_at:
        for x, y, index in loader:
            before = engine.global_steps
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
            window += every_ranks(engine, index.tolist())
            if engine.global_steps > before:
                steps.append(sorted(window))
                window = []
            if engine.global_steps in (stop_at, STEPS):
                break
    if engine.global_steps == stop_at:
        engine.save_checkpoint(checkpoints)
    weights = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
    engine.close()
    return {"steps": steps, "weights": weights}


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_resume_with_another_accumulation_at_the_same_train_batch_size_is_exact(
    tmp_path: Path, before: int, after: int
) -> None:
    # the README's case: 2 processes × micro 8 ⇄ 1 process × micro 8 × accumulation 2
    straight = run_ranks(steps_and_weights, before, str(tmp_path / "straight"), None, False)[0]
    first = run_ranks(steps_and_weights, before, str(tmp_path / "run"), 5, False)[0]
    second = run_ranks(steps_and_weights, after, str(tmp_path / "run"), None, True)[0]
    assert len(straight["steps"]) == STEPS and all(len(s) == 16 for s in straight["steps"])
    assert first["steps"] + second["steps"] == straight["steps"]
    for key, value in straight["weights"].items():
        # the same samples per step; the mean over 16 is summed in another order
        torch.testing.assert_close(second["weights"][key], value, rtol=1e-5, atol=1e-6, msg=key)
