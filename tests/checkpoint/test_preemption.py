"""A real preemption signal: the job saves, exits with 75 (requeue me), and the requeued run resumes exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spikingsail.checkpoint.preemption import PREEMPTED_EXIT_CODE
from spikingsail.checkpoint.store import CheckpointStore

pytestmark = pytest.mark.multiprocess
JOB = Path(__file__).with_name("jobs") / "elastic_job.py"


def job(out: Path, checkpoints: Path, *extra: str) -> list[str]:
    return [sys.executable, str(JOB), str(out), "--checkpoints-path", str(checkpoints), "--resume", *extra]


def wait_for_step(process: subprocess.Popen[str], progress: Path, step: int, timeout: float) -> Path:
    """Wait until rank 0 reports optimizer step ``step`` in its progress file; returns the file."""
    deadline = time.monotonic() + timeout
    while not (progress.exists() and progress.read_text() and int(progress.read_text()) >= step):
        assert time.monotonic() < deadline and process.poll() is None, "the job did not get going"
        time.sleep(0.05)
    return progress


def digest(out: Path) -> str:
    return str(json.loads((out / "rank0.json").read_text())["digest"])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_preempted_job_saves_exits_75_and_resumes_exactly(tmp_path: Path, signum: int) -> None:
    straight = subprocess.run(job(tmp_path / "straight", tmp_path / "ck-straight"), capture_output=True, text=True,
                              timeout=120, check=False)  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-2000:]

    out, checkpoints = tmp_path / "preempted", tmp_path / "ck"
    process = subprocess.Popen(
        job(out, checkpoints, "--step-sleep", "0.2"), stderr=subprocess.PIPE, text=True
    )
    progress = wait_for_step(process, out / "progress0", 3, timeout=60)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == PREEMPTED_EXIT_CODE, stderr[-2000:]
    # The signal lands between two steps or inside one: the job finishes the step under way, then saves.
    last_reported = int(progress.read_text())
    stopped_at = int(
        CheckpointStore(checkpoints).metadata(str(CheckpointStore(checkpoints).latest()))["global_steps"]
    )
    assert stopped_at in (last_reported, last_reported + 1)
    assert CheckpointStore(checkpoints).latest() == f"global_step{stopped_at}"
    assert f"preempted by signal {signal.Signals(signum).name}" in stderr

    requeued = subprocess.run(job(out, checkpoints), capture_output=True, text=True, timeout=120, check=False)
    assert requeued.returncode == 0, requeued.stderr[-2000:]
    assert json.loads((out / "rank0.json").read_text())["started_at"] == stopped_at
    assert digest(out) == digest(tmp_path / "straight")


def test_sigusr1_to_sail_launch_reaches_every_worker(tmp_path: Path) -> None:
    """SLURM's `--signal=USR1@T` path: sail launch → torchrun's agent → both workers save and exit 75."""

    def launch(out: Path, checkpoints: Path, *extra: str) -> list[str]:
        return [sys.executable, "-m", "spikingsail.cli.main", "launch", "-n", "2", str(JOB), str(out),
                "--checkpoints-path", str(checkpoints), "--resume", *extra]  # fmt: skip

    straight = subprocess.run(launch(tmp_path / "straight", tmp_path / "ck-straight"), capture_output=True,
                              text=True, timeout=180, check=False)  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-2000:]
    out, checkpoints = tmp_path / "preempted", tmp_path / "ck"
    process = subprocess.Popen(
        launch(out, checkpoints, "--step-sleep", "0.3"), stderr=subprocess.PIPE, text=True
    )
    wait_for_step(process, out / "progress0", 3, timeout=90)
    process.send_signal(signal.SIGUSR1)
    _, stderr = process.communicate(timeout=90)
    assert process.returncode != 0
    assert stderr.count("preempted by signal SIGUSR1") == 2, stderr[-3000:]
    # a stop asked for, not a crash: torchrun's agent says so in a line, with no traceback
    assert "torchrun: stopped by SIGUSR1, which it passed on to the workers" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    store = CheckpointStore(checkpoints)
    stopped_at = int(store.metadata(str(store.latest()))["global_steps"])
    requeued = subprocess.run(
        launch(out, checkpoints), capture_output=True, text=True, timeout=180, check=False
    )
    assert requeued.returncode == 0, requeued.stderr[-2000:]
    assert json.loads((out / "rank0.json").read_text())["started_at"] == stopped_at
    assert digest(out) == digest(tmp_path / "straight")


PERIODIC_AND_PREEMPTED = """
import os, signal, sys, torch, spikingsail
from spikingsail.environments import RankInfo
config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "sail": {"progress_bar": False}, "checkpoint": {"path": sys.argv[1], "interval_steps": 1}}
engine, _ = spikingsail.initialize(model=torch.nn.Linear(4, 2), config=config, rank_info=RankInfo.single())
for step in range(1, 4):
    engine.backward(engine(torch.ones(1, 4)).sum())
    if step == 2:
        os.kill(os.getpid(), signal.SIGUSR1)  # preempted on a step that also saves periodically
    engine.step()
"""


def test_a_preemption_on_a_periodic_save_step_writes_the_checkpoint_once(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(PERIODIC_AND_PREEMPTED)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "ck")], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "SAIL_LOG_LEVEL": "INFO"})  # fmt: skip
    assert result.returncode == PREEMPTED_EXIT_CODE, result.stderr[-2000:]
    saves = [line for line in result.stderr.splitlines() if "checkpoint saved:" in line]
    assert [line.rsplit("/", 1)[-1] for line in saves] == ["global_step1", "global_step2"], result.stderr
    assert "preempted by signal SIGUSR1: saved" in result.stderr
    assert CheckpointStore(tmp_path / "ck").latest() == "global_step2"
