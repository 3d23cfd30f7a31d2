"""The one supervision loop (``launchers.supervision.watch``) on real processes and real signals,
through two of the jobs it runs: a multi-node job's commands (a drain after the first signal) and a
command on this machine (every signal passed on)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.local import run_local
from spikingsail.launchers.supervision import TIMED_OUT
from spikingsail.launchers.supervisor import DRAIN_SECONDS, supervise


def signal_when(ready: Path, *signums: int) -> threading.Thread:
    """Send each of ``signums`` to this process once ``ready`` exists, the next once ``ready`` is
    rewritten (the job saw the previous one)."""

    def send() -> None:
        seen = ""
        for signum in signums:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                now = ready.read_text() if ready.exists() else ""
                if ready.exists() and now != seen:
                    seen = now
                    break
                time.sleep(0.05)
            os.kill(os.getpid(), signum)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_a_second_signal_stops_a_draining_job_at_once(tmp_path: Path) -> None:
    """A job that does not end on the first signal has the drain's time to end; a second signal
    stops it then and there, and the status is the first signal's."""
    ready, pid = tmp_path / "ready", tmp_path / "pid"
    stubborn = LaunchCommand(
        host="node1",
        argv=["sh", "-c", f"trap 'echo 2 > {ready}' USR1; echo $$ > {pid}; echo 1 > {ready}; "
                          "while :; do sleep 0.05; done"],
    )  # fmt: skip
    start = time.monotonic()
    signal_when(ready, signal.SIGUSR1, signal.SIGTERM)
    assert supervise([stubborn], output=lambda _line: None) == (128 + signal.SIGUSR1, None)
    assert time.monotonic() - start < DRAIN_SECONDS
    assert ready.read_text().strip() == "2"  # the first signal reached it
    assert not Path(f"/proc/{pid.read_text().strip()}").exists()


def test_every_signal_reaches_a_local_command_and_the_first_gives_the_status(tmp_path: Path) -> None:
    """Under torchrun's agent every signal is passed on (the agent has its own grace period): the
    command here ends on the second, and sail reports the first, as a shell would."""
    ready = tmp_path / "ready"
    counting = LaunchCommand(
        host="localhost",
        argv=["sh", "-c", f"n=0; trap 'n=$((n+1)); echo \"x$n\" > {ready}; [ $n = 2 ] && exit 3' USR1 HUP; "
                          f"echo 0 > {ready}; while :; do sleep 0.05; done"],
    )  # fmt: skip
    signal_when(ready, signal.SIGUSR1, signal.SIGHUP)
    assert run_local(counting) == (128 + signal.SIGUSR1, None)
    assert ready.read_text().strip() == "x2"


def test_a_local_command_past_its_timeout_is_stopped_with_status_124(tmp_path: Path) -> None:
    sleeper = LaunchCommand(host="localhost", argv=["sh", "-c", "echo started >&2; exec sleep 60"])
    start = time.monotonic()
    status, failure = run_local(sleeper, timeout=1.0)
    assert time.monotonic() - start < 30
    assert status == TIMED_OUT and failure is not None
    assert failure.tail[-2:] == ["started", "(timed out)"]
