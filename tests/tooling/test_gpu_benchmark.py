"""benchmarks/gpu.py's small size runs every row on a CPU, so that the GPU benchmark cannot rot."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(600)
def test_the_small_size_prints_every_row_with_its_ratio(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu import ROWS
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--small"],
        cwd=tmp_path, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout[done.stdout.index("engine÷plain  ") :]
    for row in ROWS:
        line = re.search(rf"^{re.escape(row.name)} +(\S+) +(\S+) +(\S+) +- (.*)$", table, re.MULTILINE)
        assert line, (row.name, table)
        plain, engine, ratio = (float(v) for v in line.group(1, 2, 3))
        assert plain > 0 and engine > 0
        assert ratio == pytest.approx(engine / plain, rel=0.01)
        assert ("fused kernels need CUDA" in line.group(4)) == (row.kernels != "torch")
    assert "CPU, small size" in table
