"""``sail report`` on metrics files that cannot be drawn: each refusal names the file, line and fix.
(A real run's file is drawn in tests/engine/test_stragglers.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPORT = [sys.executable, "-m", "spikingsail.cli.main", "report"]
STEP = {"step": 1, "loss": 2.0, "lr": 0.1, "samples": 8, "samples_per_sec": 100.0, "loss_scale": 1.0,
        "skipped": False, "time": 0.0}  # fmt: skip


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*REPORT, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (json.dumps(STEP) + '\n{"step": 2, "lo', r"metrics.jsonl:2: not a JSON line(.|\n)*remove it"),
        ('{"epoch": 1}\n', r"metrics.jsonl:1: a JSON line without a 'step'"),
        ("", r"metrics.jsonl: no steps"),
    ],
)
def test_a_broken_metrics_file_is_named_by_line(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "metrics.jsonl").write_text(content)
    result = report(str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.startswith("sail report: "), result.stderr
    assert "Traceback" not in result.stderr
    assert re.search(message, result.stderr), result.stderr
    assert not list(tmp_path.glob("*.png"))


def test_a_missing_run_or_a_directory_of_several_files(tmp_path: Path) -> None:
    assert "does not exist" in report(str(tmp_path / "nope")).stderr
    (tmp_path / "a.jsonl").write_text(json.dumps(STEP) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(STEP) + "\n")
    assert "2 metrics files (*.jsonl) in the directory" in report(str(tmp_path)).stderr


def test_one_process_run_without_windows_gets_its_three_plots(tmp_path: Path) -> None:
    lines = [{**STEP, "step": s, "loss": 2.0 / s, "samples": 8 * s} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = report(str(tmp_path / "metrics.jsonl"), "--out", str(tmp_path / "plots"))
    assert result.returncode == 0, result.stderr
    assert "loss          : first 2, last 0.4, lowest 0.4" in result.stdout, result.stdout
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["loss.png", "lr.png", "throughput.png"]
