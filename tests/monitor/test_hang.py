"""The hang watch on real hangs: a rank stopped with SIGSTOP and a rank deadlocked in Python, under
`sail launch -n 2`. The report must name the rank, its host and state (and the deadlock's stack),
show the other rank's collective, end the job with a failure and leave no process behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spikingsail.monitor.hangreport import stacks
from spikingsail.monitor.hangwatch import Spec
from tests.cluster.harness import processes_with

pytestmark = [pytest.mark.multiprocess, pytest.mark.alone]
JOB = Path(__file__).with_name("jobs") / "hang_job.py"
SAIL = [sys.executable, "-m", "spikingsail.cli.main", "launch"]
TIMEOUT = 4.0


def hang(tmp_path: Path, *job_args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    log_dir = tmp_path / "log"
    result = subprocess.run(
        [*SAIL, "-n", "2", str(JOB), str(log_dir), "--timeout", str(TIMEOUT), *job_args],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    reports = sorted(log_dir.glob("hang-report-*.json"))
    assert len(reports) <= 1
    return result, json.loads(reports[0].read_text()) if reports else None


def training(
    tmp_path: Path, *, timeout: float, until: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """``sail launch -n 2`` of the job in ``tmp_path``, logging to its ``log``, training until ``until`` exists."""
    argv = [*SAIL, "-n", "2", str(JOB), str(tmp_path / "log"), "--timeout", str(timeout), "--fault", "none",
            "--until", str(until)]  # fmt: skip
    return subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def assert_nothing_left(log_dir: Path) -> None:
    """No rank, launcher or watch of this test's job is left: each has the job's log directory on its
    command line (the watch as its report directory). Other tests' jobs may run beside this one."""
    pids = [int((log_dir / f"pid{rank}").read_text()) for rank in (0, 1)]
    deadline = time.monotonic() + 10
    while any(_exists(pid) for pid in pids) or _processes_of(log_dir):
        assert time.monotonic() < deadline, (
            [(pid, _state(pid)) for pid in pids if _exists(pid)],
            _processes_of(log_dir),
        )
        time.sleep(0.2)


def _processes_of(log_dir: Path) -> dict[int, str]:
    return processes_with(str(log_dir))  # pytest's tmp_path is resolved, as the watch's report directory is


def _exists(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat[stat.rindex(")") + 2]


def test_a_stopped_rank_is_named_and_the_job_ends_with_nothing_left(tmp_path: Path) -> None:
    result, report = hang(tmp_path, "--fault", "stop", "--rank", "1", "--step", "5")
    assert result.returncode != 0
    assert report is not None, result.stderr[-3000:]
    host = socket.gethostname()
    assert report["culprits"] == [1]
    one = report["ranks"][1]
    assert (one["rank"], one["host"], one["state"]) == (1, host, "stopped (SIGSTOP)")
    assert one["progress"]["step"] == 5
    zero = report["ranks"][0]
    assert zero["progress"]["phase"] == "backward" and zero["progress"]["inside"] == 2  # in the gradient sync
    verdict = (
        f"rank 1 on {host} is stopped (SIGSTOP) at step 5 in the script, after engine.step(), at main ({JOB}:"
    )
    assert report["verdict"].startswith(verdict), report["verdict"]
    assert "rank 0 waits in the gradient sync of backward (collective #" in report["verdict"]
    # found within the timeout and a few seconds of the last progress
    last = max(r["progress"]["time"] for r in report["ranks"])
    assert TIMEOUT <= report["time"] - last <= TIMEOUT + 5
    # the launch's failure reason is the verdict, on the stopped rank
    reason = result.stderr[result.stderr.rindex("sail launch: ") :]
    assert reason.startswith(
        "sail launch: node localhost failed (agent exit status 1), rank 1 (local rank 1)"
    ), reason
    assert "the rank's error:\nsail: hang: rank 1 on" in reason, reason
    assert "  why: no rank made progress for 4 s (sail.hang_timeout_seconds)" in reason
    assert_nothing_left(tmp_path / "log")


def test_a_deadlocked_rank_shows_its_stack(tmp_path: Path) -> None:
    result, report = hang(tmp_path, "--fault", "deadlock", "--rank", "0", "--step", "3")
    assert result.returncode != 0
    assert report is not None, result.stderr[-3000:]
    assert report["culprits"] == [0]
    zero = report["ranks"][0]
    assert zero["state"] == "sleeping"
    (main,) = [t for t in zero["threads"] if t["thread"] == "MainThread"]
    assert main["frames"][0].startswith(f"deadlock ({JOB}:"), main["frames"]
    assert main["frames"][1].startswith(f"main ({JOB}:")
    assert f"rank 0 on {socket.gethostname()} is behind (sleeping) at step 3" in report["verdict"]
    assert "rank 1 waits in the gradient sync of backward" in report["verdict"]
    assert f"deadlock ({JOB}:" in result.stderr  # the table's stack top
    assert_nothing_left(tmp_path / "log")


def test_a_run_that_progresses_is_never_reported(tmp_path: Path) -> None:
    # 300 steps of a few milliseconds with a 1-second timeout: start-up (before the first step)
    # and the end (ranks closing at different moments) must not count as a hang
    log_dir = tmp_path / "log"
    result = subprocess.run(
        [*SAIL, "-n", "2", str(JOB), str(log_dir), "--timeout", "1", "--fault", "none", "--steps", "300"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert not list(log_dir.glob("hang-report-*.json"))
    assert "sail: hang" not in result.stderr
    assert_nothing_left(log_dir)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MB ext4 filesystem on a loop device, whose writes ``fsfreeze`` can hold as a busy or
    failing disk does; thawed and unmounted whatever the test did. Needs root (as in CI)."""
    image, mount = tmp_path / "disk.img", tmp_path / "disk"
    with image.open("wb") as file:
        file.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", str(image)], check=True)
    mount.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["fsfreeze", "--unfreeze", str(mount)], capture_output=True, check=False)  # if frozen
        subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a loop device needs root")
def test_a_stalled_disk_under_the_temporary_directory_stalls_no_step(tmp_path: Path, disk: Path) -> None:
    """The records are in anonymous shared memory: with TMPDIR on a disk whose writes are held for
    3 s mid-run, a 1-second hang timeout reports nothing. A record in a file on that disk made its
    rank's next store wait in D state for the whole stall, and the watch ended the job."""
    log_dir, until = tmp_path / "log", tmp_path / "until"
    process = training(tmp_path, timeout=1, until=until, env={**os.environ, "TMPDIR": str(disk)})
    try:
        deadline = time.monotonic() + 90
        # both train: the watch judges from the first training call on, and each record has been stored to
        while not all((log_dir / f"training{rank}").exists() for rank in (0, 1)):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
            time.sleep(0.1)
        subprocess.run(["fsfreeze", "--freeze", str(disk)], check=True)  # writes back, then holds writes
        try:
            time.sleep(3)
        finally:
            subprocess.run(["fsfreeze", "--unfreeze", str(disk)], check=True)
        assert process.poll() is None, process.communicate()[1][-3000:]
    finally:
        until.touch()
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr[-3000:]
    assert not list(log_dir.glob("hang-report-*.json")) and "sail: hang" not in stderr
    assert_nothing_left(log_dir)


def test_without_py_spy_faulthandler_gives_a_deadlocked_stack(tmp_path: Path) -> None:
    script = tmp_path / "locked.py"
    script.write_text(textwrap.dedent(f"""
        import faulthandler, signal, threading
        faulthandler.register(signal.SIGUSR2, file=open({str(tmp_path / "stacks")!r}, "w"), all_threads=True)
        def wait_forever():
            lock = threading.Lock()
            lock.acquire()
            print("ready", flush=True)
            lock.acquire()
        wait_forever()
    """))  # fmt: skip
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        spec = Spec(records={}, host="h", timeout=1, world_size=1, nodes=1, board=None, bind="",
                    report_dir="", py_spy=None, stack_files={"0": str(tmp_path / "stacks")})  # fmt: skip
        threads, why = stacks(process.pid, spec, "0")
        assert why is None
        (main,) = [t for t in threads if t["thread"].startswith("Current thread")]
        assert main["frames"][0].startswith(f"wait_forever ({script}:"), threads
        os.kill(process.pid, signal.SIGSTOP)
        while _state(process.pid) != "T":  # the signal is delivered asynchronously
            time.sleep(0.01)
        threads, why = stacks(process.pid, spec, "0")
        assert threads == [] and why is not None and "install py-spy" in why
    finally:
        process.kill()
        process.wait()
