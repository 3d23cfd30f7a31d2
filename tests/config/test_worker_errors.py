"""A config mistake inside a training script reaches the user as SpikingSail's message, not a traceback.

Real processes: a script whose config has a bad key, run with plain python and with torchrun on two
processes; the message (what / why / fix) is printed with the rank, the traceback only with
SAIL_LOG_LEVEL=DEBUG, the exit status is 1, and torchrun's error file holds the message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import sys
import torch
import spikingsail

if "--own-hook" in sys.argv:  # an application's hook: SpikingSail passes it what is not its own
    def hook(kind, error, tb):
        print(f"own hook: {kind.__name__}: {error}", file=sys.stderr)
    sys.excepthook = hook
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
if "--bad-key" in sys.argv:
    config["gradient_clip"] = 1.0
engine, optimizer = spikingsail.initialize(model=torch.nn.Linear(2, 1), config=config)
if "--engine-error" in sys.argv:  # as the engine raises one during training
    raise spikingsail.errors.BackendError("rank 0 lost its peers", "the network went down", "restart the job")
raise ValueError("a bug of the script's own")
"""
WHAT = "<dict>: unknown key 'gradient_clip' in the top level"
FIX = "fix: did you mean 'gradient_clipping'?"


def run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    environment = {
        k: v for k, v in os.environ.items() if k not in ("SAIL_LOG_LEVEL", "TORCHELASTIC_ERROR_FILE")
    }
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env={**environment, **(env or {})},
        timeout=300,
    )  # fmt: skip


def test_plain_python_prints_the_message_with_the_rank_and_no_traceback(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"  # as torchrun sets it for each worker
    result = run(tmp_path, "--bad-key", env={"TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert result.returncode == 1
    assert f"[rank0] {WHAT}\n" in result.stderr
    assert f"[rank0]   {FIX}" in result.stderr and "[rank0]   why: " in result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    # the error file, in the format of torch's ErrorHandler: the message, and the message where
    # torchrun's summary shows the call stack
    record = json.loads(error_file.read_text())["message"]
    assert record["message"].startswith(f"ConfigError: {WHAT}\n")
    assert record["extraInfo"]["py_callstack"].startswith(f"[rank0] {WHAT}\n")
    assert "Traceback" not in record["extraInfo"]["py_callstack"]
    assert int(record["extraInfo"]["timestamp"]) > 0


def test_debug_shows_the_traceback_too(tmp_path: Path) -> None:
    result = run(tmp_path, "--bad-key", env={"SAIL_LOG_LEVEL": "DEBUG"})
    assert result.returncode == 1
    assert "Traceback (most recent call last):" in result.stderr
    assert "in load_config" in result.stderr  # where it was raised
    assert result.stderr.rstrip().splitlines()[-1].startswith(f"[rank0]   {FIX}")


def test_other_exceptions_keep_their_traceback_and_the_applications_hook(tmp_path: Path) -> None:
    plain = run(tmp_path)
    assert plain.returncode == 1
    assert "Traceback (most recent call last):" in plain.stderr
    assert plain.stderr.rstrip().endswith("ValueError: a bug of the script's own")
    own = run(tmp_path, "--own-hook")
    assert own.returncode == 1 and own.stderr.strip().endswith(
        "own hook: ValueError: a bug of the script's own"
    )
    engine_error = run(tmp_path, "--own-hook", "--engine-error")  # SpikingSail's own errors: its message
    assert engine_error.returncode == 1
    assert engine_error.stderr.rstrip().endswith(
        "[rank0] rank 0 lost its peers\n[rank0]   why: the network went down\n[rank0]   fix: restart the job"
    )


@pytest.mark.multiprocess
def test_torchrun_two_workers(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    logs = tmp_path / "logs"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--log-dir", str(logs), "--tee", "2", str(script), "--bad-key"]  # fmt: skip
    environment = {k: v for k, v in os.environ.items() if k != "SAIL_LOG_LEVEL"}
    result = subprocess.run(argv, capture_output=True, text=True, env=environment, timeout=300)
    assert result.returncode == 1
    # every worker that got as far as the config (one may be stopped by the other's failure first)
    # printed the message with its rank and no traceback
    worker_stderr = {int(p.parent.name): p.read_text() for p in logs.rglob("attempt_0/*/stderr.log")}
    printed = {rank: text for rank, text in worker_stderr.items() if text.strip()}
    assert printed, result.stderr
    for rank, text in printed.items():
        assert f"[rank{rank}] {WHAT}\n" in text and f"[rank{rank}]   {FIX}" in text
        assert "Traceback" not in text, text
    # torchrun's summary shows the message as the root cause, read from the worker's error file
    summary = result.stderr.split("Root Cause (first observed failure):")[1]
    assert WHAT in summary and FIX in summary
    assert "To enable traceback see" not in summary
    for error_file in logs.rglob("attempt_0/*/error.json"):
        assert json.loads(error_file.read_text())["message"]["message"].startswith(f"ConfigError: {WHAT}")
