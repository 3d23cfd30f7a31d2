"""benchmarks/engine_vs_ddp.py runs through at a small size (it once failed at its end unnoticed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(300)
def test_the_step_time_benchmark_prints_both_models_and_the_heartbeat(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "engine_vs_ddp.py"), "--small", "--steps", "3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for model in ("tiny (9.6k params)", "mid (5.3M params)"):
        line = re.search(
            rf"{re.escape(model)} +(\S+) +(\S+) +(\S+) +(\S+) +(\S+)$", done.stdout, re.MULTILINE
        )
        assert line, (model, done.stdout)
        hand, engine, ratio, monitoring, heartbeat = (float(v) for v in line.groups())
        assert hand > 0 and engine > 0 and monitoring > 0 and heartbeat > 0
        assert ratio == pytest.approx(engine / hand, rel=0.01)
    assert re.search(r"heartbeat alone: \d+\.\d+ µs per micro-step", done.stdout), done.stdout
