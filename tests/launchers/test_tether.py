"""A node's tether (``lifeline.py tether``): the node ends its part of the job when sail's heartbeat
stops, or its connection ends without ``done``; a real torchrun agent and worker on this machine."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spikingsail.errors import LaunchError
from spikingsail.launchers import plan
from spikingsail.launchers.agents import Rendezvous, agent_regex, rank_regex
from spikingsail.launchers.lifeline import AGENT_GRACE_SECONDS, LIFELINE, TETHER_READY
from spikingsail.launchers.request import parse_request

pytestmark = [pytest.mark.multiprocess, pytest.mark.alone]
WORKER = "import sys, time; open(sys.argv[1], 'w').close(); time.sleep(120)\n"


def agent(tmp_path: Path, run_id: str) -> subprocess.Popen[bytes]:
    """A torchrun agent started as ``sail launch`` starts one on a node, whose worker sleeps."""
    (tmp_path / "worker.py").write_text(WORKER)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", run_id,
            str(tmp_path / "worker.py"), str(tmp_path / f"{run_id}.started")]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (tmp_path / f"{run_id}.started").exists():
        assert process.poll() is None and time.monotonic() < deadline, "the agent did not start its worker"
        time.sleep(0.05)
    return process


def tether(run_id: str, timeout: int, kind: str = "agents") -> subprocess.Popen[bytes]:
    regex = agent_regex(Rendezvous(endpoint="127.0.0.1:0", run_id=run_id, nnodes=1))
    if kind == "ranks":
        regex = rank_regex(run_id)
    return subprocess.Popen(
        [sys.executable, "-I", LIFELINE, "tether", regex, str(timeout), kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def beat(processes: list[subprocess.Popen[bytes]], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for process in processes:
            assert process.stdin is not None
            process.stdin.write(b".\n")
            process.stdin.flush()
        time.sleep(0.5)


def test_silence_ends_the_nodes_agent_and_worker_and_done_leaves_them(tmp_path: Path) -> None:
    ours, other = agent(tmp_path, "tj1"), agent(tmp_path, "tj2")
    quiet, finished = tether("tj1", 3), tether("tj2", 3)
    try:
        beat([quiet, finished], 4)  # longer than the timeout: the heartbeat keeps the job alive
        assert ours.poll() is None and quiet.poll() is None
        said = finished.communicate(b"done\n", timeout=10)[0].decode()
        assert said == f"{TETHER_READY}\n" and finished.returncode == 0  # nothing ended
        silent = time.monotonic()
        assert quiet.wait(timeout=3 + AGENT_GRACE_SECONDS + 10) == 1  # its standard input still open
        assert quiet.stdout is not None
        said = quiet.stdout.read()
        assert ours.wait(timeout=AGENT_GRACE_SECONDS) is not None
        # the agent and its worker are gone within the timeout and the agent's own grace
        assert time.monotonic() - silent < 3 + AGENT_GRACE_SECONDS
        assert "no heartbeat from sail launch for 3 s" in said.decode() and str(ours.pid) in said.decode()
        assert other.poll() is None  # another job's agent, and a tether released with done: untouched
    finally:
        for process in (ours, other, quiet, finished):
            process.kill()
        subprocess.run(["pkill", "-KILL", "-f", str(tmp_path / "worker.py")], check=False)


def test_a_connection_that_ends_without_done_ends_the_nodes_part(tmp_path: Path) -> None:
    ours = agent(tmp_path, "tj3")
    cut = tether("tj3", 30)
    try:
        assert cut.stdin is not None
        cut.stdin.close()  # sail's ssh client ended: sshd closes the tether's standard input
        assert cut.wait(timeout=AGENT_GRACE_SECONDS + 10) == 1 and cut.stdout is not None
        assert "the connection to sail launch ended" in cut.stdout.read().decode()
        assert ours.wait(timeout=AGENT_GRACE_SECONDS) is not None
    finally:
        ours.kill()
        cut.kill()
        subprocess.run(["pkill", "-KILL", "-f", str(tmp_path / "worker.py")], check=False)


def test_every_node_gets_a_tether_with_ssh_keepalive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").touch()
    (tmp_path / "hostfile").write_text("node1 slots=2\nnode2 slots=2\n")
    for launcher in ("ssh", "pdsh"):
        commands = plan(parse_request(["-H", "hostfile", "--launcher", launcher, "--heartbeat-timeout", "12",
                                       "--rdzv-id", "job7", "train.py"]))  # fmt: skip
        tethers = [c for c in commands if c.heartbeat]
        assert [c.host for c in tethers] == ["node1", "node2"]
        for command in tethers:
            argv = command.argv
            assert argv[argv.index("--") + 1] == command.host
            assert {"ServerAliveInterval=4", "ServerAliveCountMax=3"} <= set(argv)
            assert argv[-1].split()[:4] == [sys.executable, "-I", LIFELINE, "tether"]
            assert argv[-1].endswith(" 12 agents") and "job7" not in argv[-1]  # the id only as a pattern


def test_a_heartbeat_timeout_under_three_seconds_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").touch()
    with pytest.raises(LaunchError, match="--heartbeat-timeout 2"):
        parse_request(["-H", "a:1,b:1", "--heartbeat-timeout", "2", "train.py"])


def test_the_tether_is_standard_library_only() -> None:
    # it runs on every node with -I: nothing of spikingsail or torch is imported
    source = Path(LIFELINE).read_text()
    assert "import torch" not in source and "spikingsail" not in source.split('"""', 2)[2].split("def ")[0]
    assert os.path.isabs(LIFELINE)


def test_mpirun_and_horovodrun_ranks_carry_the_jobs_mark_and_only_other_hosts_get_a_tether(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").touch()
    for launcher in ("mpirun", "horovodrun"):
        commands = plan(parse_request(["-H", "localhost:1,node2:1", "--launcher", launcher, "--rdzv-id", "job7",
                                       "train.py"]))  # fmt: skip
        job, *tethers = commands
        assert job.argv[job.argv.index(sys.executable, 1) + 1 :][:2] == ["-X", "sail-run=job7"]
        assert [t.host for t in tethers] == ["node2"] and all(t.heartbeat for t in tethers)
        assert shlex.split(tethers[0].argv[-1])[3:] == ["tether", rank_regex("job7"), "30", "ranks"]


# A rank (mpirun, horovodrun) that saves for 2 s on SIGTERM before it exits, as the engine does.
SAVING_RANK = """
import signal, sys, time
def save(signum, frame):
    time.sleep(2)
    open(sys.argv[1], "w").close()
    sys.exit(75)
signal.signal(signal.SIGTERM, save)
open(sys.argv[1] + ".ready", "w").close()
time.sleep(120)
"""


def test_a_rank_gets_the_grace_period_to_save_before_it_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(SAVING_RANK)
    saved = tmp_path / "saved"
    rank = subprocess.Popen([sys.executable, "-X", "sail-run=tj4", str(script), str(saved)])
    cut = tether("tj4", 3, "ranks")
    try:
        deadline = time.monotonic() + 30
        while not Path(f"{saved}.ready").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert cut.wait(timeout=3 + AGENT_GRACE_SECONDS + 10) == 1  # no heartbeat
        assert rank.wait(timeout=10) == 75 and saved.exists()  # it saved; it was not killed after 1 s
    finally:
        rank.kill()
        cut.kill()
