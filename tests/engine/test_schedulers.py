"""DeepSpeed's learning-rate schedules, checked against their formulas at chosen steps."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

from spikingsail.optim import schedulers as spikingsail_schedulers
from spikingsail.optim.schedulers import OneCycle, WarmupDecayLR, WarmupLR


def optimizer(**defaults: float) -> torch.optim.Optimizer:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1.0, **defaults)  # type: ignore[arg-type]


def two_groups() -> torch.optim.Optimizer:
    """Two parameter groups at their own learning rates, neither DeepSpeed's 0.001."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.05},
              {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2}]  # fmt: skip
    return torch.optim.Adam(groups, lr=1.0)


def lrs(schedule: WarmupLR | OneCycle, steps: int) -> list[float]:
    out = [schedule.optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        schedule.step()
        out.append(schedule.optimizer.param_groups[0]["lr"])
    return out


def test_warmup_log() -> None:
    values = lrs(WarmupLR(optimizer(), warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10), 12)
    assert values[0] == 0.0  # before the first step: the minimum
    assert values[1] == 0.0  # iteration 0: log(1) = 0
    assert values[2] == pytest.approx(0.1 * math.log(2) / math.log(10))
    assert values[11] == values[12] == pytest.approx(0.1)


def test_warmup_linear() -> None:
    values = lrs(
        WarmupLR(
            optimizer(), warmup_min_lr=0.01, warmup_max_lr=0.11, warmup_num_steps=4, warmup_type="linear"
        ),
        6,
    )
    assert values[1:6] == pytest.approx([0.01, 0.035, 0.06, 0.085, 0.11])


def test_warmup_decay() -> None:
    values = lrs(
        WarmupDecayLR(
            optimizer(), total_num_steps=8, warmup_max_lr=0.2, warmup_num_steps=4, warmup_type="linear"
        ),
        10,
    )
    assert values[5] == pytest.approx(0.2)  # iteration 4: warm-up done
    assert values[7] == pytest.approx(0.2 * (8 - 6) / 4)
    assert values[9] == values[10] == 0.0


def test_one_cycle_lr_and_momentum() -> None:
    schedule = OneCycle(
        optimizer(),
        cycle_min_lr=0.1,
        cycle_max_lr=1.0,
        cycle_first_step_size=4,
        decay_lr_rate=0.5,
        decay_step_size=2,
    )
    values = lrs(schedule, 12)
    assert values[0] == pytest.approx(0.1)  # before the first step: the minimum
    assert values[1] == pytest.approx(0.1 + 0.9 * 0.25)  # the first step is a quarter of the way up
    assert values[4] == pytest.approx(1.0)  # peak after cycle_first_step_size steps
    assert values[8] == pytest.approx(0.1)  # back down after the second half
    assert values[10] == pytest.approx(0.1 / (1 + 0.5 * 1))  # decay: divided, 2 steps past the cycle
    assert schedule.optimizer.param_groups[0]["betas"] == pytest.approx((0.9, 0.99))


def test_state_dict_restores_the_rate() -> None:
    a = WarmupLR(optimizer(), warmup_max_lr=0.5, warmup_num_steps=10, warmup_type="linear")
    lrs(a, 5)
    b = WarmupLR(optimizer(), warmup_max_lr=0.5, warmup_num_steps=10, warmup_type="linear")
    b.load_state_dict(a.state_dict())
    assert b.get_last_lr() == a.get_last_lr()
    assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]


# DeepSpeed's own schedules are the reference: a DeepSpeed config must train with the same learning
# rates (and, for OneCycle, the same Adam betas) here.
DEEPSPEED_CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.11, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_max_lr": 0.1, "warmup_num_steps": 1, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 8, "warmup_max_lr": 0.2, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 3, "warmup_max_lr": 0.2, "warmup_num_steps": 5}),
    # without warmup_max_lr: WarmupLR rises to each group's own rate, WarmupDecayLR to 0.001
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_num_steps": 6}),
    ("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 4, "decay_lr_rate": 0.5,
                  "decay_step_size": 2}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3,
                  "cycle_second_step_size": 5, "decay_lr_rate": 0.2, "decay_step_size": 3, "decay_mom_rate": 0.01}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4, "cycle_second_step_size": 0}),
    ("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": 0.1, "cycle_first_step_size": 6, "cycle_second_step_size": 4,
                  "cycle_first_stair_count": 3, "cycle_second_stair_count": 2}),
    ("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": 0.1, "cycle_first_step_size": 4, "cycle_first_stair_count": 2,
                  "cycle_momentum": False}),
]  # fmt: skip


@pytest.fixture(scope="module")
def deepspeed_schedules() -> Any:
    """DeepSpeed's lr_schedules module; importing DeepSpeed exports variables, which are put back."""
    saved = dict(os.environ)
    try:
        from deepspeed.runtime import lr_schedules
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return lr_schedules


@pytest.mark.parametrize(("name", "params"), DEEPSPEED_CASES)
def test_the_schedules_are_deepspeeds(deepspeed_schedules: Any, name: str, params: dict[str, float]) -> None:
    for make in (optimizer, two_groups):
        ours = getattr(spikingsail_schedulers, name)(make(), **params)
        theirs = getattr(deepspeed_schedules, name)(make(), **params)
        for step in range(25):
            for group, (ours_group, theirs_group) in enumerate(
                zip(ours.optimizer.param_groups, theirs.optimizer.param_groups, strict=True)
            ):
                where = f"group {group} of {make.__name__} after {step} steps"
                assert ours_group["lr"] == pytest.approx(theirs_group["lr"], abs=1e-12), f"lr, {where}"
                assert ours_group["betas"] == pytest.approx(theirs_group["betas"], abs=1e-12), (
                    f"betas, {where}"
                )
            ours.step()
            theirs.step()
