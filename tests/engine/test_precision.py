"""fp16 loss scaling follows DeepSpeed's DynamicLossScaler; bf16 and fp16 forwards really autocast."""

from __future__ import annotations

import pytest
import torch

from spikingsail.config.schema import FP16Config
from spikingsail.engine.precision import BF16Precision, FP16Precision

CPU = torch.device("cpu")


def test_dynamic_scale_hysteresis_and_growth() -> None:
    scaler = FP16Precision(
        CPU,
        FP16Config(enabled=True, initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=2),
    )
    assert scaler.loss_scale == 16
    scaler.update(overflow=True)  # first overflow spends the hysteresis budget
    assert scaler.loss_scale == 16
    scaler.update(overflow=True)
    assert scaler.loss_scale == 8
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.loss_scale == 16  # doubled after a window of clean steps
    for _ in range(5):
        scaler.update(overflow=True)
    assert scaler.loss_scale == 2  # never below min_loss_scale


def test_static_scale_never_moves() -> None:
    scaler = FP16Precision(CPU, FP16Config(enabled=True, loss_scale=128))
    scaler.update(overflow=True)
    scaler.update(overflow=False)
    assert scaler.loss_scale == 128


def test_unscale_detects_overflow_and_unscales() -> None:
    scaler = FP16Precision(CPU, FP16Config(enabled=True, initial_scale_power=3))
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([param], lr=1)
    param.grad = torch.tensor([8.0, 16.0, 24.0])
    assert scaler.unscale_(optimizer) is False
    assert param.grad.tolist() == [1.0, 2.0, 3.0]
    param.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert scaler.unscale_(optimizer) is True


def test_state_round_trip() -> None:
    a = FP16Precision(CPU, FP16Config(enabled=True))
    a.update(overflow=True)
    a.update(overflow=True)
    b = FP16Precision(CPU, FP16Config(enabled=True))
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [
        (FP16Precision(CPU, FP16Config(enabled=True)), torch.float16),
        (BF16Precision(CPU), torch.bfloat16),
    ],
)
def test_forward_runs_under_autocast(precision: FP16Precision, dtype: torch.dtype) -> None:
    layer = torch.nn.Linear(4, 4)
    with precision.autocast():
        assert layer(torch.randn(2, 4)).dtype == dtype
