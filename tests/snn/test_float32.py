"""snn.float32.float32_exact (the time chunks' check runs under it): full float32 inside, the user's settings after.

TF32 settings are per process and torch's legacy readers raise once a process has used the new
per-operator settings, so each case runs in a forked process of its own (run_ranks with one rank).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.multiprocess import run_ranks

OPERATORS = ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


def _holder(path: str) -> Any:
    backend, operator = path.split(".")
    return getattr(getattr(torch.backends, backend), operator)


def _settings() -> dict[str, Any]:
    cudnn = torch.backends.cudnn
    found: dict[str, Any] = {path: _holder(path).fp32_precision for path in OPERATORS}
    return {**found, "benchmark": cudnn.benchmark, "deterministic": cudnn.deterministic}


def _set_by_user(how: str) -> None:
    if how == "legacy":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
    elif how == "new-generic":
        backends: Any = torch.backends  # the generic setting is not in torch's stubs
        backends.fp32_precision = "tf32"
    else:
        _holder("cuda.matmul").fp32_precision = "tf32"
        _holder("mkldnn.matmul").fp32_precision = "bf16"
    torch.backends.cudnn.benchmark = True


def _case(how: str) -> dict[str, Any]:
    from spikingjelly.activation_based import functional

    from spikingsail.config.schema import SNNConfig
    from spikingsail.snn.chunking import time_chunked
    from spikingsail.snn.float32 import float32_exact
    from tests.snn.models import chunkable_snn

    _set_by_user(how)
    before = _settings()
    with float32_exact("cpu"):
        inside = _settings()
        autocast = torch.is_autocast_enabled("cpu")
    after = _settings()
    legacy = torch.get_float32_matmul_precision() if how == "legacy" else None
    model = chunkable_snn(8)
    functional.set_step_mode(model, "m")
    chunked = time_chunked(model, SNNConfig(step_mode="m", time_chunk=4), "spikingjelly", True, "test")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the check turns the user's autocast off for itself
        chunked(torch.rand(8, 2, 1, 4, 4)).sum().backward()  # the first chunked forward runs the check
    return {
        "before": before,
        "inside": inside,
        "after": after,
        "autocast": autocast,
        "legacy": legacy,
        "after_training": _settings(),
    }


@pytest.mark.parametrize("how", ["legacy", "new-generic", "new-per-operator"])
def test_float32_inside_and_the_users_tf32_settings_after(how: str) -> None:
    result = run_ranks(_case, 1, how)[0]
    assert result["inside"] == {**dict.fromkeys(OPERATORS, "ieee"), "benchmark": False, "deterministic": True}
    assert result["autocast"] is False
    assert result["after"] == result["before"] == result["after_training"]
    assert result["before"]["benchmark"] is True
    if how == "legacy":
        assert result["legacy"] == "high"  # the legacy reader still reads what the user set
    else:
        assert "ieee" not in result["before"].values()  # the case set something float32_exact changes
