"""The supervisor on real local processes: node failures reported in a stream, and cleanups."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from spikingsail.launchers.command import LaunchCommand, Upload
from spikingsail.launchers.pdsh import NODE_FAILURE
from spikingsail.launchers.supervisor import DRAIN_SECONDS, supervise


def pdsh_like(report: str, tmp_path: Path) -> LaunchCommand:
    """A command that reports a node's failure the way pdsh does, then runs on for the other node."""
    return LaunchCommand(
        host="node1,node2",
        argv=["sh", "-c", f"echo 'node2: rank output'; echo '{report}'; sleep 60"],
        node_failure=NODE_FAILURE,
        cleanup=["sh", "-c", f"echo cleaned up; touch {tmp_path / 'cleaned'}"],
    )


@pytest.mark.parametrize(
    ("report", "status"),
    [
        ("pdsh@node1: node2: ssh exited with exit code 3", 3),
        ("pdsh@node1: node2: ssh killed by signal 9", 128 + 9),
        ("pdsh@node1: node2: ssh exited with nonzero status 0x0100", 1),
    ],
)
def test_a_node_failure_reported_by_pdsh_stops_the_job(tmp_path: Path, report: str, status: int) -> None:
    lines: list[str] = []
    start = time.monotonic()
    code, failure = supervise([pdsh_like(report, tmp_path)], output=lines.append)
    assert time.monotonic() - start < 30  # not the 60 s the command would run
    assert code == status
    assert failure is not None and failure.host == "node2"
    # the stopped command's cleanup ran and what it said was relayed with its host
    assert "[node1,node2] cleaned up" in lines and (tmp_path / "cleaned").exists()


def test_a_rank_printing_pdshs_words_is_not_a_node_failure(tmp_path: Path) -> None:
    # pdsh puts its host prefix before everything a node prints, so a rank's own line never
    # starts the way pdsh's reports do
    command = LaunchCommand(
        host="node1,node2",
        argv=["sh", "-c", "echo 'node2: pdsh@node1: node2: ssh exited with exit code 3'; exit 0"],
        node_failure=NODE_FAILURE,
        cleanup=["sh", "-c", f"touch {tmp_path / 'cleaned'}"],
    )
    assert supervise([command], output=lambda _line: None) == (0, None)
    assert not (tmp_path / "cleaned").exists()  # nothing was stopped, nothing to clean up


def test_only_the_stopped_commands_are_cleaned_up(tmp_path: Path) -> None:
    failing = LaunchCommand(
        host="node2",
        argv=["sh", "-c", "sleep 0.5; exit 4"],
        cleanup=["sh", "-c", f"touch {tmp_path / 'node2-cleaned'}"],
    )
    running = LaunchCommand(
        host="node1",
        argv=["sleep", "60"],
        cleanup=["sh", "-c", f"touch {tmp_path / 'node1-cleaned'}"],
    )
    code, failure = supervise([failing, running], output=lambda _line: None)
    assert code == 4 and failure is not None and failure.host == "node2"
    assert (tmp_path / "node1-cleaned").exists()
    assert not (tmp_path / "node2-cleaned").exists()  # it ended by itself


def test_a_cleanup_that_fails_is_reported(tmp_path: Path) -> None:
    lines: list[str] = []
    command = LaunchCommand(host="node1", argv=["sleep", "60"], cleanup=["sh", "-c", "exit 255"])
    supervise([command], output=lines.append, timeout=0.5)
    assert any(line.startswith("[node1] could not check for processes the job left") for line in lines), lines


def test_uploads_go_first_over_standard_input(tmp_path: Path) -> None:
    upload = Upload(
        host="node1", argv=["sh", "-c", f"cat > {tmp_path / 'received'}"], env={"B": "2 3", "A": "1"}
    )
    command = LaunchCommand(host="node1", argv=["sh", "-c", f"cp {tmp_path / 'received'} {tmp_path / 'seen'}"],
                            uploads=[upload])  # fmt: skip
    assert supervise([command], output=lambda _line: None) == (0, None)
    assert (tmp_path / "seen").read_text() == "export A=1\nexport B='2 3'\n"  # there before the command ran


def test_a_failed_upload_starts_nothing(tmp_path: Path) -> None:
    refused = Upload(host="node2", argv=["sh", "-c", "cat >/dev/null; echo 'Permission denied' >&2; exit 255"],
                     env={"A": "1"})  # fmt: skip
    command = LaunchCommand(host="node1,node2", argv=["touch", str(tmp_path / "started")], uploads=[refused],
                            cleanup=["touch", str(tmp_path / "cleaned")])  # fmt: skip
    code, failure = supervise([command], output=lambda _line: None)
    assert code == 255 and failure is not None and failure.host == "node2"
    assert "Permission denied" in failure.describe()
    assert not (tmp_path / "started").exists() and (tmp_path / "cleaned").exists()


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_a_signal_is_passed_on_and_the_job_ends_by_itself(tmp_path: Path, signum: signal.Signals) -> None:
    """One command gets the signal itself (as srun and mpirun do), the other through its relay (as
    ssh's agents do); the job ends as they end, not at the drain's deadline."""
    ready = tmp_path / "ready"
    itself = LaunchCommand(
        host="node1",
        argv=["sh", "-c", f"trap 'exit 75' {signum.name[3:]}; touch {ready}; while :; do sleep 0.05; done"],
    )
    relayed = LaunchCommand(
        host="node2",
        argv=["sh", "-c", f"while [ ! -s {tmp_path / 'relayed'} ]; do sleep 0.05; done"],
        relay=["sh", "-c", f'echo "$0" > {tmp_path / "relayed"}'],
    )

    def send() -> None:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signum)  # handled by supervise: it is waiting for the job by then

    start = time.monotonic()
    threading.Thread(target=send, daemon=True).start()
    assert supervise([itself, relayed], output=lambda _line: None) == (128 + signum, None)
    assert (tmp_path / "relayed").read_text().strip() == signum.name[3:]
    assert time.monotonic() - start < DRAIN_SECONDS
