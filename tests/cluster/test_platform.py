"""Platform mode on two real nodes: each node gets MASTER_ADDR/PORT, RANK = node rank, WORLD_SIZE = nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.harness import NamespaceCluster
from tests.cluster.test_ssh_pdsh import JOB, assert_no_job_left

pytestmark = pytest.mark.cluster


def test_node_ranks_from_the_platform_order_the_global_ranks(
    cluster: NamespaceCluster, tmp_path: Path
) -> None:
    # The platform numbers node2 first: its worker must become global rank 0.
    node_rank = {"node1": "1", "node2": "0"}
    processes = {}
    for node, rank in node_rank.items():
        env = {**os.environ, "MASTER_ADDR": "node2", "MASTER_PORT": "29611", "RANK": rank, "WORLD_SIZE": "2"}
        argv = [
            sys.executable,
            "-m",
            "spikingsail.cli.main",
            "launch",
            "--nproc-per-node",
            "1",
            str(JOB),
            str(tmp_path / "out"),
        ]
        processes[node] = subprocess.Popen(
            cluster.node_argv(node, argv),
            env=env,
            cwd=tmp_path,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    outputs = {node: p.communicate(timeout=180)[0] for node, p in processes.items()}
    assert all(p.returncode == 0 for p in processes.values()), outputs
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("rank*.json"))]
    assert [(r["rank"], r["host"], r["world_size"]) for r in records] == [(0, "node2", 2), (1, "node1", 2)]
    assert records[0]["digest"] == records[1]["digest"]
    assert "platform mode: node 1 of 2, master node2:29611" in outputs["node1"]
    assert_no_job_left(cluster)
