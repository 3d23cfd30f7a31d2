"""`sail launch -H` across two real nodes (network namespaces with sshd): ssh and pdsh."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.harness import NamespaceCluster

pytestmark = pytest.mark.cluster
JOB = Path(__file__).with_name("jobs") / "ddp_job.py"
SAIL = [sys.executable, "-m", "spikingsail.cli.main", "launch"]


def hostfile(tmp_path: Path, text: str = "node1 slots=1\nnode2 slots=1\n") -> Path:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


def launch(
    cluster: NamespaceCluster, tmp_path: Path, *flags: str, job_args: tuple[str, ...] = ()
) -> tuple[int, str, str]:
    argv = [
        *SAIL,
        "-H",
        str(hostfile(tmp_path)),
        "--ssh-config",
        str(cluster.ssh_config),
        *flags,
        str(JOB),
        str(tmp_path / "out"),
        *job_args,
    ]
    result = cluster.run("node1", argv, cwd=tmp_path)
    return result.returncode, result.stdout, result.stderr


def records(tmp_path: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("rank*.json"))]


def assert_no_job_left(cluster: NamespaceCluster) -> None:
    deadline = time.monotonic() + 20
    while True:
        leftovers = list(cluster.job_processes().values())
        if not leftovers:
            return
        assert time.monotonic() < deadline, f"processes left on the nodes: {leftovers}"
        time.sleep(0.5)


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_two_nodes_train_to_identical_parameters(
    cluster: NamespaceCluster, tmp_path: Path, launcher: str
) -> None:
    code, out, err = launch(cluster, tmp_path, "--launcher", launcher)
    assert code == 0, out[-3000:] + err[-3000:]
    ranks = records(tmp_path)
    assert [(r["rank"], r["host"], r["world_size"], r["source"]) for r in ranks] == [
        (0, "node1", 2, "torchrun"),
        (1, "node2", 2, "torchrun"),
    ]
    assert ranks[0]["digest"] == ranks[1]["digest"]
    # each node's output is relayed with its host: ssh's as "[node2] ", pdsh's as "node2: "
    assert re.search(r"(\[node2\] |node2: )rank 1 trained 8 steps", out), out[-3000:]
    assert_no_job_left(cluster)


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_a_worker_killed_on_node2_stops_both_nodes(
    cluster: NamespaceCluster, tmp_path: Path, launcher: str
) -> None:
    start = time.monotonic()
    code, _out, err = launch(
        cluster, tmp_path, "--launcher", launcher, job_args=("--steps", "200", "--die-rank", "1")
    )
    assert code != 0
    assert "node node2 failed" in err, err
    assert "rank 1 (local rank 0) exited with -9 (SIGKILL)" in err, err
    assert records(tmp_path) == []
    assert_no_job_left(cluster)
    assert time.monotonic() - start < 120


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_a_rank_failing_after_its_peers_finished_ends_the_job_at_once(
    cluster: NamespaceCluster, tmp_path: Path, launcher: str
) -> None:
    # node1's agent is done and waits in torchrun's exit barrier for node2's, which failed and
    # never comes: 300 s, unless the launcher stops the job when node2 fails. pdsh itself returns
    # only when every host is done; its report of node2's exit is what ends the job.
    start = time.monotonic()
    code, out, err = launch(cluster, tmp_path, "--launcher", launcher, job_args=("--exit-rank", "1"))
    assert code != 0
    assert "node node2 failed" in err, err
    assert "rank 1 (local rank 0) exited with 3" in err, err
    assert [r["rank"] for r in records(tmp_path)] == [0, 1]  # both ranks did their work
    # node1's agent does not answer the hang-up from inside its barrier; it is killed, and named
    assert "killed torchrun agent" in out, out[-3000:]
    assert_no_job_left(cluster)
    assert time.monotonic() - start < 120


def test_unreachable_host_fails_fast_and_starts_nothing(cluster: NamespaceCluster, tmp_path: Path) -> None:
    hostfile(tmp_path, "node1 slots=1\nnode3 slots=1\n")
    argv = [
        *SAIL,
        "-H",
        str(tmp_path / "hostfile"),
        "--ssh-config",
        str(cluster.ssh_config),
        "--connect-timeout",
        "3",
        str(JOB),
        str(tmp_path / "out"),
    ]
    start = time.monotonic()
    result = cluster.run("node1", argv, cwd=tmp_path)
    assert result.returncode == 2
    assert "cannot reach 1 of 2 host(s)" in result.stderr
    assert "node3:" in result.stderr and "nothing was started" in result.stderr
    assert time.monotonic() - start < 30
    assert_no_job_left(cluster)


def test_host_that_wants_a_password_is_named(cluster: NamespaceCluster, tmp_path: Path) -> None:
    argv = [
        *SAIL,
        "-H",
        str(hostfile(tmp_path)),
        "--ssh-config",
        str(cluster.workdir / "stranger_config"),
        str(JOB),
        str(tmp_path / "out"),
    ]
    result = cluster.run("node1", argv, cwd=tmp_path)
    assert result.returncode == 2
    assert "node1: the host refused the key" in result.stderr
    assert "node2: the host refused the key" in result.stderr
    assert "ssh-copy-id" in result.stderr


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_sigterm_to_the_launcher_stops_every_node(
    cluster: NamespaceCluster, tmp_path: Path, launcher: str
) -> None:
    argv = [
        *SAIL,
        "-H",
        str(hostfile(tmp_path)),
        "--ssh-config",
        str(cluster.ssh_config),
        "--launcher",
        launcher,
        str(JOB),
        str(tmp_path / "out"),
        "--steps",
        "100000",
    ]
    process = subprocess.Popen(
        cluster.node_argv("node1", argv),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 90
    while not all((tmp_path / "out" / f"started{r}").exists() for r in (0, 1)):
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, "the job did not start on both nodes"
        time.sleep(0.3)
    process.send_signal(signal.SIGTERM)
    out = process.communicate(timeout=60)[0]
    assert process.returncode == 128 + signal.SIGTERM, out
    # each node's agent says in one line that it was stopped; its SignalException traceback is not shown
    assert "Traceback" not in out, out
    for node in ("node1", "node2"):
        assert re.search(rf"(\[{node}\] |{node}: )torchrun: stopped by SIGTERM", out), out
    assert_no_job_left(cluster)
