"""A scheduler the user built on their own optimizer and passed as ``lr_scheduler=`` drives the learning
rate under every backend, including those that step another optimizer object (ZeRO-1's
ZeroRedundancyOptimizer, Horovod's DistributedOptimizer), as in one process: 2 real gloo ranks
against a single-process reference at the same global batch."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.environments import RankInfo
from spikingsail.errors import BackendError
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.multiprocess
GLOBAL_BATCH, ACCUMULATION, STEPS = 16, 2, 6


def train(backend: str, stage: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": ACCUMULATION,
        "zero_optimization": {"stage": stage},
        "sail": {"backend": backend, "seed": 3, "progress_bar": False},
    }
    rank_info = RankInfo.single() if world_size == 1 else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, _ = spikingsail.initialize(
            model=net, optimizer=optimizer, lr_scheduler=scheduler, config=config, rank_info=rank_info
        )
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g))
        lrs = []
        for x, y in engine.dataloader(data, shuffle=False):
            engine.backward(F.cross_entropy(engine(x).float(), y))
            steps = engine.global_steps
            engine.step()
            if engine.global_steps > steps:
                lrs.append(engine.get_lr()[0])
            if engine.global_steps == STEPS:
                break
    params = {k: whole(v) for k, v in engine.module.named_parameters()}
    engine.close()
    warned = [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]
    return {"params": params, "lrs": lrs, "warned": warned}


def whole(param: torch.Tensor) -> torch.Tensor:
    """A parameter's full value (FSDP's are sharded DTensors)."""
    full = param.full_tensor() if isinstance(param, DTensor) else param
    return full.detach().float().clone()


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    return train("ddp", 0, 1)


@pytest.mark.parametrize(
    ("backend", "stage"), [("ddp", 0), ("ddp", 1), ("fsdp", 3), ("horovod", 0), ("deepspeed", 1)]
)
def test_the_users_scheduler_drives_the_learning_rate(
    single: dict[str, Any], backend: str, stage: int
) -> None:
    assert single["lrs"] == pytest.approx([0.5, 0.05, 0.05, 0.005, 0.005, 0.0005])
    for rank, result in run_ranks(train, 2, backend, stage, 2).items():
        assert result["lrs"] == pytest.approx(single["lrs"]), rank
        assert result["warned"] == [], result["warned"]
        for key, value in single["params"].items():
            # the same samples per step, summed in another order: float32 rounding only
            torch.testing.assert_close(result["params"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_replaced_optimizer_with_copied_groups_is_refused() -> None:
    from spikingsail.optim.rebind import rebind_scheduler

    net = torch.nn.Linear(2, 2)
    given = torch.optim.SGD(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(given, step_size=1)
    copied = torch.optim.SGD([dict(group) for group in given.param_groups], lr=0.1)
    with pytest.raises(BackendError, match=r"(?s)do not share parameter groups.*silently ignored"):
        rebind_scheduler(scheduler, given, copied, "ddp")
