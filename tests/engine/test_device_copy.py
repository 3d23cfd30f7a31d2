"""The engine's collective paths under a GPU's device-copy semantics (tests/device_copy.py), on 2 gloo ranks."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.checkpoint.store import CheckpointStore
from tests.device_copy import copying_device_moves
from tests.multiprocess import run_ranks


def test_a_device_move_copies_inside_and_aliases_outside() -> None:
    t = torch.zeros(2)
    assert t.to("cpu") is t
    with copying_device_moves():
        moved = t.to("cpu")
        moved += 1
        assert moved is not t and float(t.sum()) == 0
        assert t.to(torch.float32) is t  # a dtype-only cast keeps its semantics (as on a GPU)
        net = torch.nn.Linear(2, 2)
        weight = net.weight
        assert net.to("cpu").weight is weight  # modules keep their Parameter objects
    assert t.to(torch.device("cpu")) is t


def interval_save(checkpoints: str) -> list[str]:
    with copying_device_moves():
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 2)
        engine, _ = spikingsail.initialize(
            model=net,
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            config={
                "train_micro_batch_size_per_gpu": 2,
                # a broken agreement shows as a 6 s collective timeout, not a hang
                "sail": {"progress_bar": False, "timeout_minutes": 0.1},
                "checkpoint": {"path": checkpoints, "interval_seconds": 0.05},
            },
        )
        if engine.rank == 1:
            engine.checkpointer._last_save = time.monotonic() + 3600  # this rank's clock says: not due
        data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
        for x, y in engine.dataloader(data, shuffle=False):
            time.sleep(0.1)
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
        engine.close()
        return CheckpointStore(checkpoints).tags()


@pytest.mark.multiprocess
def test_interval_seconds_saves_on_every_rank_when_rank_zero_says_so(tmp_path: Path) -> None:
    # rank 0's clock decides; ranks whose clocks disagree still enter the save together
    results: dict[int, Any] = run_ranks(interval_save, 2, str(tmp_path))
    assert results[0] == results[1] == ["global_step1", "global_step2"]
