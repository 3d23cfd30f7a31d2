"""A worker SIGKILLed mid-epoch under `sail launch --max-restarts 2 --resume`: the job finishes as if nothing happened."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess
JOB = Path(__file__).with_name("jobs") / "elastic_job.py"


def launch(out: Path, checkpoints: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "spikingsail.cli.main", "launch", "-n", "2", "--max-restarts", "2",
            str(JOB), str(out), "--checkpoints-path", str(checkpoints), "--resume", *extra]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, cwd=out.parent)


def results(out: Path) -> list[dict[str, object]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_killed_worker_restarts_from_the_latest_checkpoint(tmp_path: Path) -> None:
    straight = launch(tmp_path / "straight", tmp_path / "ckpt-straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    crashed = launch(tmp_path / "crashed", tmp_path / "ckpt-crashed", "--kill-rank", "1", "--kill-step", "7")
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert (tmp_path / "crashed" / "killed-once").exists(), "the worker was never killed"
    assert "resumed from" in crashed.stderr and "global_step6" in crashed.stderr
    reference, recovered = results(tmp_path / "straight"), results(tmp_path / "crashed")
    assert [r["digest"] for r in recovered] == [r["digest"] for r in reference]
    # The restarted group began at the last checkpoint (step 6): one step (step 7) was lost.
    assert [r["started_at"] for r in recovered] == [6, 6]
