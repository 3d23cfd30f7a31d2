"""fp16 loss scaling follows DeepSpeed's DynamicLossScaler; bf16 and fp16 forwards really autocast."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from spikingsail.config.schema import FP16Config
from spikingsail.errors import SailError
from spikingsail.precision import BF16Precision, FP16Precision

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
    assert scaler.loss_scale == 8  # the step after an overflow does not count towards the window
    scaler.update(overflow=False)
    assert scaler.loss_scale == 16  # doubled after a window of clean steps
    for _ in range(4):
        scaler.update(overflow=True)
    assert scaler.loss_scale == 2  # halved down to min_loss_scale
    with pytest.raises(
        SailError, match=r"overflowed at the minimum loss scale \(fp16.min_loss_scale 2\)"
    ) as err:
        scaler.update(overflow=True)  # at the minimum: every further step would be skipped
    assert "lower the learning rate, or train in bf16" in str(err.value)


# DeepSpeed's DynamicLossScaler (what its ZeRO optimizers step) and ours, fed the same overflows.
# Its update_scale asks deepspeed.comm for the rank when it logs, so it runs in a process with a
# one-rank group.
AGAINST_DEEPSPEED = """
import json, os, random, sys
import torch, torch.distributed as dist
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
from spikingsail.config.schema import FP16Config
from spikingsail.precision import FP16Precision
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
deepspeed.init_distributed("gloo")
out = []
for case, (window, hysteresis, consecutive, power, floor) in enumerate(json.loads(sys.argv[1])):
    rng = random.Random(case)
    ours = FP16Precision(torch.device("cpu"), FP16Config(enabled=True, initial_scale_power=power, loss_scale_window=window,
                         hysteresis=hysteresis, consecutive_hysteresis=consecutive, min_loss_scale=floor))
    theirs = DynamicLossScaler(init_scale=2.0**power, scale_window=window, min_scale=floor, delayed_shift=hysteresis,
                               consecutive_hysteresis=consecutive)
    seen = []
    for step in range(200):
        overflow = rng.random() < 0.35
        pair = []
        for update in (ours.update, theirs.update_scale):
            try:
                update(overflow)
                pair.append(None)
            except Exception as err:  # ours: SailError; DeepSpeed's: a bare Exception
                pair.append(type(err).__name__)
        seen.append([overflow, ours.loss_scale, theirs.cur_scale, *pair])
        if pair != [None, None]:
            break
    out.append(seen)
print(json.dumps(out))
dist.destroy_process_group()
"""


def test_the_dynamic_scale_is_deepspeeds_step_for_step() -> None:
    cases = [
        (1, 1, False, 4, 1),
        (2, 1, False, 4, 4),
        (3, 2, False, 6, 1),
        (2, 2, True, 5, 2),
        (5, 3, False, 8, 1),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, "-c", AGAINST_DEEPSPEED, json.dumps(cases)],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    runs = json.loads(result.stdout.strip().splitlines()[-1])
    stopped = 0
    for case, seen in zip(cases, runs, strict=True):
        scales = [scale for _, scale, *_ in seen]
        rose = any(b > a for a, b in itertools.pairwise(scales))
        assert rose or seen[-1][3] is not None, (
            f"{case}: the scale never grew nor stopped; the case tests little"
        )
        for step, (overflow, ours, theirs, our_error, their_error) in enumerate(seen):
            where = f"case {case}, step {step} (overflow {overflow})"
            assert ours == theirs, f"{where}: scale {ours} here, {theirs} in DeepSpeed"
            # both stop at the same step: DeepSpeed with a bare Exception, SpikingSail with its own error
            assert (our_error is None) == (their_error is None), (
                f"{where}: {our_error} here, {their_error} in DeepSpeed"
            )
            stopped += our_error == "SailError"
    assert stopped >= 1, "no case reached an overflow at the minimum scale"


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
