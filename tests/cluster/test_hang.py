"""The hang watch across two real nodes: a rank on node2 stopped with SIGSTOP under `sail launch -H`.
The report (made on node1) names node2's rank and its state, the job fails, and nothing is left on
either node — the stopped rank included. The board that node2's watch reached listened on node1's
interface, not on all of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster.harness import NamespaceCluster
from tests.cluster.test_ssh_pdsh import SAIL, assert_no_job_left, hostfile
from tests.monitor.test_hang import JOB, TIMEOUT

pytestmark = [pytest.mark.cluster, pytest.mark.alone]


def test_a_rank_stopped_on_node2_is_named_and_nothing_is_left(
    cluster: NamespaceCluster, tmp_path: Path
) -> None:
    log_dir = tmp_path / "log"
    argv = [
        *SAIL, "-H", str(hostfile(tmp_path)), "--ssh-config", str(cluster.ssh_config),
        str(JOB), str(log_dir), "--timeout", str(TIMEOUT), "--fault", "stop", "--rank", "1", "--step", "5",
    ]  # fmt: skip
    result = cluster.run("node1", argv, cwd=tmp_path)
    assert result.returncode != 0
    (report_path,) = log_dir.glob("hang-report-*.json")
    report = json.loads(report_path.read_text())
    assert report["culprits"] == [1]
    assert [(r["rank"], r["host"]) for r in report["ranks"]] == [(0, "node1"), (1, "node2")]
    assert report["ranks"][1]["state"] == "stopped (SIGSTOP)"
    assert report["verdict"].startswith("rank 1 on node2 is stopped (SIGSTOP) at step 5"), report["verdict"]
    assert "rank 0 waits in the gradient sync of backward (collective #" in report["verdict"]
    last = max(r["progress"]["time"] for r in report["ranks"])
    assert TIMEOUT <= report["time"] - last <= TIMEOUT + 5
    assert "sail: hang: rank 1 on node2 is stopped (SIGSTOP)" in result.stderr + result.stdout
    # node1's watch served the board on node1's interface only; node2's listened on nothing
    node1 = json.loads((log_dir / "watch0.json").read_text())["listening"]
    assert [address.rsplit(":", 1)[0] for address in node1] == [cluster.address["node1"]], node1
    assert json.loads((log_dir / "watch1.json").read_text())["listening"] == []
    assert_no_job_left(cluster)
