"""DeepSpeed's learning-rate schedules, checked against their formulas at chosen steps."""

from __future__ import annotations

import math

import pytest
import torch

from spikingsail.optim.schedulers import OneCycle, WarmupDecayLR, WarmupLR


def optimizer(**defaults: float) -> torch.optim.Optimizer:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1.0, **defaults)  # type: ignore[arg-type]


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
    assert values[1] == pytest.approx(0.1)
    assert values[3] == pytest.approx(0.1 + 0.9 * 0.5)
    assert values[5] == pytest.approx(1.0)  # peak after cycle_first_step_size
    assert values[9] == pytest.approx(0.1)  # back down after the second half
    assert values[11] == pytest.approx(0.1 * (1 + 0.5 * 1))  # decay: 2 steps past the cycle
    assert schedule.optimizer.param_groups[0]["betas"][0] == pytest.approx(0.9)


def test_state_dict_restores_the_rate() -> None:
    a = WarmupLR(optimizer(), warmup_max_lr=0.5, warmup_num_steps=10, warmup_type="linear")
    lrs(a, 5)
    b = WarmupLR(optimizer(), warmup_max_lr=0.5, warmup_num_steps=10, warmup_type="linear")
    b.load_state_dict(a.state_dict())
    assert b.get_last_lr() == a.get_last_lr()
    assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
