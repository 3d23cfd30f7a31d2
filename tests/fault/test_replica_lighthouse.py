"""torchft's lighthouse of a job of replica groups: killed mid-run and started again, its port taken,
a shell's proxy, a lighthouse that never answers."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from spikingsail.errors import LaunchError
from spikingsail.launchers.replicas import ReplicaPlan, free_port
from tests.cluster.harness import processes_with
from tests.fault.replicas import (
    assert_trained_as_one_process,
    child_with,
    ended_on_failure,
    finish,
    group_entries,
    launch,
    ledger,
    lighthouse_status,
    wait_for_worker,
)
from tests.launchers.test_local import wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.alone]


def test_the_lighthouse_killed_mid_run_is_started_again_and_training_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "run"
    job = launch(out, wait=False)
    with ended_on_failure(job):  # mid-run: once the groups took a step together (group 1 can start late)
        wait_for(
            lambda: any(not entry["alone"] for entry in group_entries(out, 0)), 120, "no step of both groups"
        )
        os.kill(child_with(job.pid, "torchft_lighthouse"), signal.SIGKILL)
    assert "torchft's lighthouse ended" in finish(job)
    assert_trained_as_one_process(out, tmp_path)


def test_a_group_first_meeting_another_under_a_restarted_lighthouse_heals_over_a_new_process_group(
    tmp_path: Path,
) -> None:
    """A lighthouse started again numbers its quorums from 1 again. Group 0 trains alone in the first
    lighthouse's quorum 1 and pauses; the lighthouse is killed and started again; group 1 joins and
    waits for group 0, which continues: the two first meet in the second lighthouse's quorum 1.
    torchft builds a process group only for a new quorum id: while the ids were the lighthouse's alone,
    group 0 sent its state to group 1 over its one-process group and crashed (SIGSEGV in gloo), was
    started again from step 0, and its first steps differed from those taken again. The engine's
    quorum ids name the members too."""
    out = tmp_path / "run"
    job = launch(out, "--hold-group", "1", wait=False)
    with ended_on_failure(job):
        wait_for_worker(out, group=0)
        (out / "pause-0").touch()
        wait_for((out / "paused-0").exists, 60, "group 0 did not pause")
        first = child_with(job.pid, "torchft_lighthouse")
        os.kill(first, signal.SIGKILL)
        # the second lighthouse hears group 0's heartbeats, then group 1 asks it for a quorum
        wait_for(lambda: "sail_0" in lighthouse_status(job.pid), 60, "no heartbeat of group 0's there")
        (out / "go-1").touch()
        wait_for(lambda: "at least half of 2" in lighthouse_status(job.pid), 60, "group 1 not waiting")
        (out / "pause-0").unlink()
    output = finish(job)
    assert "replica group 0 ended" not in output, output[-4000:]  # not crashed, not started again
    entries = sorted(ledger(out), key=lambda entry: entry["time"])
    before = [entry for entry in entries if entry["group"] == 0 and entry["alone"]]
    met = next(entry for entry in entries if entry["group"] == 0 and not entry["alone"])
    assert before[0]["lighthouse"] == met["lighthouse"] == 1  # the same number, other members
    assert_trained_as_one_process(out, tmp_path)


def test_a_lighthouse_port_taken_after_it_was_chosen_is_replaced_before_the_groups_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """free_port's port can be taken before the lighthouse binds it (it is an ephemeral port that
    another process's socket may get): the lighthouse ends at once, and the groups, started with its
    address, would wait for it until torchft's connect timeout and fail. sail launch sees it end,
    chooses another port, and starts the groups only once the lighthouse answers."""
    from spikingsail.cli import launch as cli_launch
    from spikingsail.launchers import replicas
    from spikingsail.launchers import run as launch_run

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    ports, free = iter([port]), replicas.free_port
    monkeypatch.setattr(replicas, "free_port", lambda: next(ports, None) or free())
    monkeypatch.setattr(launch_run, "free_port", replicas.free_port)
    script = tmp_path / "reach.py"
    script.write_text(
        "import os, urllib.request\n"
        "address = os.environ['TORCHFT_LIGHTHOUSE']\n"
        "direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))\n"
        "status = direct.open(address + '/status', timeout=5).read().decode()\n"
        f"open({str(tmp_path)!r} + '/group-' + os.environ['REPLICA_GROUP_ID'], 'w').write(address + ' ' + status)\n"
    )
    with taken, caplog.at_level("WARNING"):
        status = cli_launch.run(["--ft-replicas", "2", "-n", "1", "--max-restarts", "0", str(script)])
    assert status == 0
    assert f"could not listen on port {port}" in caplog.text
    reached = [(tmp_path / f"group-{g}").read_text() for g in range(2)]
    assert all("quorum" in text for text in reached)
    assert reached[0].split()[0] == reached[1].split()[0] != f"http://127.0.0.1:{port}"


def test_the_lighthouse_is_reached_directly_whatever_the_shells_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from spikingsail.launchers.command import LaunchCommand
    from spikingsail.launchers.replicas import lighthouse_argv, start_lighthouse

    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    plan = ReplicaPlan(
        groups=2, heartbeat_timeout_ms=1000, join_timeout_ms=10000, lighthouse_port=free_port()
    )
    lighthouse = start_lighthouse(
        LaunchCommand(host="localhost", argv=lighthouse_argv(plan)), plan, within=20
    )
    assert lighthouse is not None and lighthouse.poll() is None
    lighthouse.kill()
    lighthouse.wait()


def test_a_lighthouse_that_never_answers_is_a_clear_error(tmp_path: Path) -> None:
    from spikingsail.launchers.command import LaunchCommand
    from spikingsail.launchers.replicas import start_lighthouse

    plan = ReplicaPlan(
        groups=2, heartbeat_timeout_ms=1000, join_timeout_ms=10000, lighthouse_port=free_port()
    )
    program = f"import time; time.sleep(60)  # {tmp_path}"
    silent = LaunchCommand(host="localhost", argv=[sys.executable, "-c", program])
    started = time.monotonic()
    with pytest.raises(LaunchError, match=f"did not answer at 127.0.0.1:{plan.lighthouse_port} within 1 s"):
        start_lighthouse(silent, plan, within=1.0)
    assert time.monotonic() - started < 10
    assert not processes_with(str(tmp_path)), "the lighthouse that did not answer was left running"
