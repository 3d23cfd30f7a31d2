"""Replica groups over the two nodes (``sail launch --ft-replicas 2 -H``): one group per node, the
lighthouse on node1 where sail runs. Real faults: node2's torchrun agent SIGKILLed, and a 5 s network
cut between the nodes (iptables). The job goes on, node2's group heals from node1's, and the run
equals one process on the whole global batch (tests/fault/replicas.py has the checks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.harness import NamespaceCluster
from tests.fault.replicas import (
    EPOCHS,
    STEPS_PER_EPOCH,
    WORKER,
    assert_trained_as_one_process,
    wait_for_worker,
)
from tests.fault.test_replica_exposure import listening, loopback

pytestmark = [pytest.mark.cluster, pytest.mark.alone]
SAIL = [sys.executable, "-m", "spikingsail.cli.main", "launch"]


def start(
    cluster: NamespaceCluster, tmp_path: Path, *worker_args: str, step_sleep: float = 0.4
) -> tuple[subprocess.Popen[str], Path]:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    out = tmp_path / "run"
    out.mkdir()
    argv = [*SAIL, "-H", str(hostfile), "--ssh-config", str(cluster.ssh_config), "--ft-replicas", "2",
            "--ft-heartbeat-timeout", "3", "--max-restarts", "3",
            str(WORKER), str(out), str(EPOCHS), "--step-sleep", str(step_sleep), *worker_args]  # fmt: skip
    job = subprocess.Popen(
        cluster.node_argv("node1", argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        cwd=tmp_path,
    )  # fmt: skip
    return job, out


def finish(job: subprocess.Popen[str], out: Path) -> str:
    output, _ = job.communicate(timeout=240)
    (out / "output.txt").write_text(output)
    assert job.returncode == 0, output[-5000:]
    return output


def agent_on(cluster: NamespaceCluster, node: str) -> int:
    """The pid of the job's torchrun agent on ``node``."""
    for pid in cluster.pids(node):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:3] == [b"-m", b"torch.distributed.run"]:
            return pid
    raise AssertionError(f"no torchrun agent on {node}")


def assert_no_job_left(cluster: NamespaceCluster) -> None:
    deadline = time.monotonic() + 20
    while cluster.job_processes():
        assert time.monotonic() < deadline, f"processes left on the nodes: {cluster.job_processes()}"
        time.sleep(0.5)


def assert_both_groups_finished(out: Path) -> None:
    for group in (0, 1):
        assert (out / f"steps-{group}").read_text().split()[0] == str(EPOCHS * STEPS_PER_EPOCH)


def test_node2s_agent_killed_the_group_is_started_again_and_heals_from_node1(
    cluster: NamespaceCluster, tmp_path: Path
) -> None:
    # min_replicas 2: group 0 waits for group 1's restart (ssh, torchrun and the engine take 15-25 s
    # here, more on a loaded machine) instead of racing it to the end of the run
    job, out = start(cluster, tmp_path, "--min-replicas", "2")
    worker = wait_for_worker(out, 1)
    agent = agent_on(cluster, "node2")
    os.kill(agent, signal.SIGKILL)
    output = finish(job, out)
    assert not Path(f"/proc/{worker}").exists()  # the orphaned worker ended with its agent
    assert "replica group 1 ended with status" in output and "starting it again" in output
    assert "replica group 1 in the job at step" in output  # healed from group 0, not from step 0
    assert len(list(out.glob("ledger-1-*.jsonl"))) == 2  # the first worker and the restarted group's
    assert_trained_as_one_process(out, tmp_path)
    assert_both_groups_finished(out)
    assert_no_job_left(cluster)


def test_a_5_second_network_cut_leaves_node2s_group_out_and_it_heals(
    cluster: NamespaceCluster, tmp_path: Path
) -> None:
    """Before the cut, with both groups running, the job's torchft services listen on the nodes' own
    addresses, never on every interface (``assert_listening_on_the_nodes_own_addresses``)."""
    job, out = start(cluster, tmp_path)
    try:
        wait_for_worker(out, 1)
        wait_for_worker(out, 0)
        assert_listening_on_the_nodes_own_addresses(cluster, torchft_sockets(cluster))
    except BaseException:
        job.send_signal(signal.SIGINT)
        job.communicate(timeout=120)
        raise
    iptables = ["ip", "netns", "exec", cluster.netns["node2"], "iptables"]
    rules = [["INPUT", "-s", cluster.address["node1"], "-j", "DROP"],
             ["OUTPUT", "-d", cluster.address["node1"], "-j", "DROP"]]  # fmt: skip
    for rule in rules:
        subprocess.run([*iptables, "-A", *rule], check=True)
    try:
        time.sleep(5)
    finally:
        for rule in rules:
            subprocess.run([*iptables, "-D", *rule], check=True)
    output = finish(job, out)
    assert "replica group 1 was left behind" in output  # left out, then healed from group 0
    # torch's c10d line at every connection of a node without a reverse name: explained once per sail
    # launch (the job's, and each group's), not repeated
    assert "The hostname of the client socket cannot be retrieved" not in output
    assert 1 <= output.count("torch's c10d store found no name") <= 3
    assert len(list(out.glob("ledger-1-*.jsonl"))) >= 1
    assert_trained_as_one_process(out, tmp_path)
    assert_both_groups_finished(out)
    assert_no_job_left(cluster)


Sockets = dict[tuple[str, int], list[tuple[Any, int]]]


def torchft_sockets(cluster: NamespaceCluster) -> Sockets:
    """What the lighthouse and each group's worker listen on, per (node, pid), while the job runs."""
    found = {}
    for node in ("node1", "node2"):
        for pid in cluster.pids(node):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                sockets = listening(pid)
            except OSError:
                continue
            if (
                argv[1].endswith(b"torchft_lighthouse.py") or str(WORKER).encode() in argv[1:3]
            ):  # python [-u] replica_worker.py
                found[(node, pid)] = sockets
    return found


def assert_listening_on_the_nodes_own_addresses(cluster: NamespaceCluster, found: Sockets) -> None:
    """Across nodes: the lighthouse on node1's address towards the nodes, each group's manager and
    process group on its node's address towards the lighthouse; none on every interface. torchrun's
    agents are left out (their c10d store is torch's and listens on every interface)."""
    assert {node for node, _ in found} == {"node1", "node2"}
    for (node, pid), sockets in found.items():
        assert sockets, f"{node} {pid} listens on nothing"
        wrong = [s for s in sockets if not loopback(s[0]) and str(s[0]) != cluster.address[node]]
        assert wrong == [], f"{node} {pid} listens on {wrong}"
