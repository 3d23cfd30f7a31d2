"""The main job's script, unchanged, under every backend: only the config's backend key differs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spikingsail.launchers.replicas import free_port
from tests.examples.test_examples import ROOT, sail_launch

pytestmark = pytest.mark.multiprocess
SCRIPT = str(ROOT / "examples" / "train_digits.py")


def config_for(tmp_path: Path, backend: str, **extra: Any) -> str:
    config = json.loads((ROOT / "examples" / "configs" / "digits.json").read_text())
    config["sail"]["backend"] = backend
    config.update(extra)
    path = tmp_path / f"{backend}.json"
    path.write_text(json.dumps(config))
    return str(path)


def run(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=300, cwd=cwd)


def accuracy(result: subprocess.CompletedProcess[str]) -> float:
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"test accuracy: ([0-9.]+) \(359 images, 2 processes\)", result.stdout)
    assert match, result.stdout
    return float(match.group(1))


@pytest.mark.parametrize(("backend", "extra"), [("fsdp", {}), ("ddp", {"zero_optimization": {"stage": 1}})])
def test_the_main_job_reaches_95_percent_under(tmp_path: Path, backend: str, extra: dict[str, Any]) -> None:
    result = sail_launch(SCRIPT, "--sail-config", config_for(tmp_path, backend, **extra), cwd=tmp_path)
    assert accuracy(result) >= 0.95
    assert f"backend                 : {backend}" in result.stderr


def test_the_main_job_reaches_95_percent_on_deepspeed_under_its_own_launcher(tmp_path: Path) -> None:
    """The deepspeed backend's run of the main job, started as a DeepSpeed user starts it (one run for
    both: `sail launch` of the deepspeed backend is in tests/checkpoint/test_storage_faults.py and the
    matrix)."""
    config = config_for(tmp_path, "deepspeed", zero_optimization={"stage": 2})
    deepspeed = str(Path(sys.executable).with_name("deepspeed"))
    result = run(
        # a free port, not the launcher's default 29500: the suite runs other jobs beside this one
        deepspeed, "--num_gpus", "2", "--master_port", str(free_port()), SCRIPT, "--deepspeed",
        "--deepspeed_config", config, cwd=tmp_path,
    )  # fmt: skip
    assert accuracy(result) >= 0.95
    assert "spawned with command" in result.stdout + result.stderr  # DeepSpeed's launcher started the ranks
    assert "backend                 : deepspeed" in result.stderr
