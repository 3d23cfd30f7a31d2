"""`sail launch`: torchrun's flags as data, and real local runs with real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spikingsail.errors import LaunchError
from spikingsail.launchers import plan
from spikingsail.launchers.request import FORWARDED_SIGNALS, parse_request

SAIL = [sys.executable, "-m", "spikingsail.cli.main"]


def test_n_becomes_nproc_per_node_and_single_node_is_standalone(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.touch()
    (command,) = plan(
        parse_request(["-n", "2", "--max-restarts", "1", str(script), "--lr", "0.1", "-n", "7"])
    )
    assert command.host == "localhost"
    assert command.argv[1:] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--signals-to-handle",
        FORWARDED_SIGNALS,
        str(script),
        "--lr",
        "0.1",
        "-n",
        "7",
    ]


def test_explicit_rendezvous_is_not_overridden(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.touch()
    request = parse_request(["--nproc-per-node=2", "--master-port=29555", str(script)])
    assert request.torchrun_args == [
        "--nproc-per-node=2",
        "--master-port=29555",
        "--signals-to-handle",
        FORWARDED_SIGNALS,
    ]
    request = parse_request(["--nnodes=2", "--rdzv-endpoint=node1:29400", str(script)])
    assert "--standalone" not in request.torchrun_args


def test_missing_script_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match=r"training script .*nope\.py does not exist"):
        parse_request(["-n", "2", str(tmp_path / "nope.py")])


def run_sail(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SAIL, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_unknown_flag_is_an_error_with_usage(tmp_path: Path) -> None:
    result = run_sail("launch", "--nprocs", "2", "x.py", cwd=tmp_path)
    assert result.returncode == 2
    assert "usage: sail launch" in result.stderr


def test_cli_error_has_no_traceback(tmp_path: Path) -> None:
    result = run_sail("launch", "-n", "2", "missing.py", cwd=tmp_path)
    assert result.returncode == 2
    assert "training script missing.py does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_dry_run_prints_the_command_and_runs_nothing(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    result = run_sail("launch", "-n", "2", "--dry-run", str(script), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[localhost]" in result.stdout and "--nproc-per-node 2" in result.stdout
    assert "must not run" not in result.stderr


@pytest.mark.multiprocess
def test_a_failing_worker_fails_the_launch(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit('rank 1 broke')\n")
    result = run_sail("launch", "-n", "2", str(script), cwd=tmp_path)
    assert result.returncode != 0
    assert "rank 1 broke" in result.stderr


@pytest.mark.multiprocess
def test_sigterm_stops_every_worker(tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text(
        "import os, pathlib, time\n"
        f"pathlib.Path(r'{tmp_path}', 'pid' + os.environ['RANK']).write_text(str(os.getpid()))\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen(
        [*SAIL, "launch", "-n", "2", str(script)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    pid_files = [tmp_path / "pid0", tmp_path / "pid1"]
    deadline = time.monotonic() + 60
    while not all(p.exists() and p.read_text() for p in pid_files):
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.2)
    workers = [int(p.read_text()) for p in pid_files]
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) != 0
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived the launcher"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; only its parent has not collected it yet.
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.multiprocess
def test_a_plain_torchrun_script_runs_unchanged(tmp_path: Path) -> None:
    import json

    plain = Path(__file__).parents[1] / "cluster" / "jobs" / "plain_ddp.py"
    result = run_sail("launch", "-n", "2", str(plain), str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("rank*.json"))]
    assert [(r["rank"], r["world_size"], r["local_rank"]) for r in records] == [(0, 2, 0), (1, 2, 1)]
    assert records[0]["digest"] == records[1]["digest"]
