"""The README's jobs, end to end through `sail launch -n 2`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.multiprocess


def sail_launch(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spikingsail.cli.main", "launch", "-n", "2", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def why(result: subprocess.CompletedProcess[str]) -> str:
    """What a failed launch printed: the end of its output (how far training got) and of its errors,
    less the list of extension modules a crashing rank's faulthandler prints."""
    errors = "\n".join(line for line in result.stderr.splitlines() if "Extension modules:" not in line)
    return f"stdout: ...{result.stdout[-1500:]}\nstderr: ...{errors[-6000:]}"


def test_main_job_reaches_95_percent(tmp_path: Path) -> None:
    result = sail_launch(str(ROOT / "examples" / "train_digits.py"), cwd=tmp_path)
    assert result.returncode == 0, why(result)
    match = re.search(r"test accuracy: ([0-9.]+) \(359 images, 2 processes\)", result.stdout)
    assert match, result.stdout
    assert float(match.group(1)) >= 0.95
    metrics = [json.loads(line) for line in (tmp_path / "runs/digits/metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == len(metrics) and metrics[-1]["samples"] == 64 * len(metrics)
    assert "[rank0]" in result.stderr


def test_snn_example_reaches_90_percent(tmp_path: Path) -> None:
    result = sail_launch(str(ROOT / "examples" / "snn_digits.py"), cwd=tmp_path)
    assert result.returncode == 0, why(result)
    match = re.search(r"test accuracy: ([0-9.]+) \(359 images, 2 processes\)", result.stdout)
    assert match, result.stdout
    assert float(match.group(1)) >= 0.90


def test_seed_000_script_runs_as_written(tmp_path: Path) -> None:
    example = ROOT / "examples" / "seed000"
    result = sail_launch(
        str(example / "train.py"),
        "--deepspeed",
        "--deepspeed_config",
        str(example / "ds_config.json"),
        "--epochs",
        "1",
        cwd=tmp_path,
    )
    assert result.returncode == 0, why(result)
    assert re.search(r"finished 180 steps, last loss [0-9.]+, loss scale \d+", result.stdout), result.stdout
    # its "zero_optimization": true is ZeRO-1: the optimizer state is sharded on the DDP backend
    assert "ZeRO-1: optimizer state sharded over 2 ranks (ZeroRedundancyOptimizer)" in result.stderr


def test_config_mistake_stops_every_rank_with_the_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_batch_size": 7, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    result = sail_launch(str(ROOT / "examples" / "train_digits.py"), "--sail-config", str(bad), cwd=tmp_path)
    assert result.returncode != 0
    assert "inconsistent batch sizes for 2 process(es)" in result.stderr
