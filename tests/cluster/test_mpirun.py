"""`sail launch --launcher mpirun` across two real nodes: Open MPI starts the ranks, the engine reads OMPI_*."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.cluster.harness import NamespaceCluster
from tests.cluster.test_ssh_pdsh import JOB, SAIL, assert_no_job_left, hostfile

pytestmark = pytest.mark.cluster
# The namespaces' only link; without these Open MPI also tries the host's other interfaces.
MCA = "--mca btl_tcp_if_include 10.99.0.0/24 --mca oob_tcp_if_include 10.99.0.0/24"


def mpirun_launch(cluster: NamespaceCluster, tmp_path: Path, *job_args: str) -> tuple[int, str]:
    assert shutil.which("mpirun"), "Open MPI is missing: run the suite through scripts/test.sh"
    argv = [
        *SAIL,
        "-H",
        str(hostfile(tmp_path)),
        "--ssh-config",
        str(cluster.ssh_config),
        "--launcher",
        "mpirun",
        "--launcher-args",
        MCA,
        "--master-port",
        "29622",
        str(JOB),
        str(tmp_path / "out"),
        *job_args,
    ]
    result = cluster.run("node1", argv, cwd=tmp_path)
    return result.returncode, result.stdout + result.stderr


def test_two_nodes_train_under_mpirun(cluster: NamespaceCluster, tmp_path: Path) -> None:
    code, output = mpirun_launch(cluster, tmp_path)
    assert code == 0, output[-4000:]
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("rank*.json"))]
    assert [(r["rank"], r["host"], r["source"]) for r in records] == [
        (0, "node1", "openmpi"),
        (1, "node2", "openmpi"),
    ]
    assert records[0]["digest"] == records[1]["digest"]
    assert_no_job_left(cluster)


def test_a_rank_killed_under_mpirun_stops_the_job_and_is_named(
    cluster: NamespaceCluster, tmp_path: Path
) -> None:
    start = time.monotonic()
    code, output = mpirun_launch(cluster, tmp_path, "--steps", "500", "--die-rank", "1")
    assert code != 0
    assert "mpirun failed" in output and "node node2, rank 1 exited with signal 9" in output, output[-4000:]
    assert_no_job_left(cluster)
    assert time.monotonic() - start < 120
