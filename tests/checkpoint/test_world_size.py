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
from spikingsail.errors import ConfigError
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


# -- epochs that are not a whole number of optimizer steps ----------------------------------------

RAGGED = 200
"""Samples of the ragged dataset: 12 steps of 16 and a short step of 8 per epoch (the reviewer's case)."""


def ragged_dataset(length: int) -> TensorDataset:
    g = torch.Generator().manual_seed(4)
    return TensorDataset(
        torch.randn(length, 4, generator=g), torch.randint(0, 2, (length,), generator=g), torch.arange(length)
    )


def ragged(
    checkpoints: str, length: int, micro: int, stop: int | None, resume: bool, drop_last: bool
) -> dict[str, Any]:
    """Two epochs at train_batch_size 16 and micro-batch ``micro`` per process (the accumulation
    follows); ``stop``: save after this many micro-steps. Returns every optimizer step's sample ids
    (over ranks and micro-steps) and the final weights."""
    torch.manual_seed(0)
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": micro,
              "optimizer": {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}},
              "sail": {"seed": 5, "progress_bar": False}}  # fmt: skip
    engine, _ = spikingsail.initialize(model=torch.nn.Linear(4, 2), config=config, checkpoints_path=checkpoints,
                                       resume=resume)  # fmt: skip
    loader = engine.dataloader(ragged_dataset(length), drop_last=drop_last)
    total = 2 * -(-length // 16) if not drop_last else 2 * (length // 16)
    steps: list[list[int]] = []
    window: list[int] = []
    while engine.global_steps < total and engine.micro_steps != stop:
        for x, y, index in loader:
            before = engine.global_steps
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
            window += every_ranks(engine, index.tolist())
            if engine.global_steps > before:
                steps.append(sorted(window))
                window = []
            if engine.global_steps == total or engine.micro_steps == stop:
                break
    if engine.micro_steps == stop:
        engine.save_checkpoint(checkpoints)
    weights = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
    engine.close()
    return {"steps": steps, "window": sorted(window), "weights": weights}


_one_process: dict[tuple[int, bool], dict[str, Any]] = {}


def one_process(tmp_path: Path, length: int, drop_last: bool) -> dict[str, Any]:
    """The uninterrupted run of one process taking every step in one micro-batch of 16 (the short
    step in one batch of its samples)."""
    if (length, drop_last) not in _one_process:
        result = run_ranks(ragged, 1, str(tmp_path / "reference"), length, 16, None, False, drop_last)[0]
        _one_process[length, drop_last] = result
    return _one_process[length, drop_last]


def assert_trains_like(result: dict[str, Any], reference: dict[str, Any]) -> None:
    for key, value in reference["weights"].items():
        # the same samples per step; the mean over them is summed in another order
        torch.testing.assert_close(result["weights"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize(
    ("processes", "micro", "length", "drop_last"),
    [(2, 8, 201, False), (2, 4, RAGGED, False), (1, 8, RAGGED, False), (2, 4, 201, True)],
    ids=["2x8-201", "2x4xacc2-200", "1x8xacc2-200", "2x4xacc2-201-drop_last"],
)
def test_a_ragged_epoch_trains_as_one_process_on_any_split(
    tmp_path: Path, processes: int, micro: int, length: int, drop_last: bool
) -> None:
    reference = one_process(tmp_path, length, drop_last)
    result = run_ranks(ragged, processes, str(tmp_path / "run"), length, micro, None, False, drop_last)[0]
    sizes = [len(step) for step in reference["steps"]]
    assert sizes == 2 * ([16] * (length // 16) + ([] if drop_last else [length % 16]))
    assert result["steps"] == reference["steps"]
    assert_trains_like(result, reference)


@pytest.mark.parametrize(
    ("before", "after", "stop_step", "length"),
    [(2, 1, 5, RAGGED), (1, 2, 5, 201), (2, 1, 12, RAGGED), (1, 2, 12, 201), (2, 1, 13, RAGGED), (1, 2, 13, RAGGED)],
    ids=["2to1-mid-epoch", "1to2-mid-epoch", "2to1-before-the-short-step", "1to2-before-the-short-step",
         "2to1-after-the-short-step", "1to2-after-the-short-step"],
)  # fmt: skip
def test_a_ragged_epoch_resumes_exactly_on_another_world_size(
    tmp_path: Path, before: int, after: int, stop_step: int, length: int
) -> None:
    # micro 8 at train_batch_size 16: 2 processes × accumulation 1 ⇄ 1 process × accumulation 2; with
    # 201 samples the short step of 9 is 5 + 4 on 2 processes (DistributedSampler would pad it)
    reference = one_process(tmp_path, length, False)
    stop = stop_step * (2 // before)  # in the first run's micro-steps
    first = run_ranks(ragged, before, str(tmp_path / "run"), length, 8, stop, False, False)[0]
    second = run_ranks(ragged, after, str(tmp_path / "run"), length, 8, None, True, False)[0]
    assert first["steps"] + second["steps"] == reference["steps"]
    assert_trains_like(second, reference)


def test_a_save_inside_the_short_steps_window_resumes_exactly(tmp_path: Path) -> None:
    # 2 processes × micro 4 × accumulation 2: the short step of 8 is two micro-batches of 2 per
    # process; the save falls between them
    reference = one_process(tmp_path, RAGGED, False)
    first = run_ranks(ragged, 2, str(tmp_path / "run"), RAGGED, 4, 12 * 2 + 1, False, False)[0]
    second = run_ranks(ragged, 2, str(tmp_path / "run"), RAGGED, 4, None, True, False)[0]
    assert len(first["window"]) == 4
    second["steps"][0] = sorted(first["window"] + second["steps"][0])
    assert first["steps"] + second["steps"] == reference["steps"]
    assert_trains_like(second, reference)


def refused_loader(length: int) -> str:
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "sail": {"progress_bar": False},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}  # fmt: skip
    engine, _ = spikingsail.initialize(model=torch.nn.Linear(4, 2), config=config)
    try:
        engine.dataloader(ragged_dataset(length))
    except ConfigError as err:
        return str(err)
    finally:
        engine.close()
    return "accepted"


def test_a_short_step_smaller_than_its_micro_batches_is_refused_before_training() -> None:
    # 2 processes × micro 2 × accumulation 4 = 8 micro-batches, and 196 = 12 × 16 + 4
    message = run_ranks(refused_loader, 2, 196)[0]
    assert "the last optimizer step of every epoch has 4 sample(s)" in message
    assert "fewer than its 4 micro-step(s) × 2 process(es)" in message
    assert "drop_last=True" in message
    assert run_ranks(refused_loader, 2, 200)[0] == "accepted"  # 8 samples: one each
