"""The practice cluster of ``scripts/two-nodes.sh`` (``python -m tests.cluster.harness``) used as a
newcomer uses it: their own command on node1, and a shell there, with plain ``ssh node2`` and
``sail launch -H`` working without ``--ssh-config`` (node1's ``~/.ssh`` is the cluster's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
HARNESS = [sys.executable, "-m", "tests.cluster.harness"]


def environment() -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def test_a_users_own_script_runs_on_both_nodes_with_the_clusters_ssh_settings(tmp_path: Path) -> None:
    script = tmp_path / "mine.py"
    script.write_text(
        "import os, socket\nprint('mine', os.environ['RANK'], socket.gethostname(), flush=True)\n"
    )
    command = f"ssh node2 hostname && sail launch -H {{hostfile}} {script}"
    done = subprocess.run([*HARNESS, "--", "sh", "-c", command], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=environment(), check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[cluster] hostfile" in done.stdout and "ssh node2 works there" in done.stdout
    assert done.stdout.splitlines()[4] == "node2"  # after the four [cluster] lines: plain ssh reached it
    assert "mine 0 node1" in done.stdout and "mine 1 node2" in done.stdout


def test_a_shell_on_node1_has_the_hostfile_and_reaches_node2(tmp_path: Path) -> None:
    done = subprocess.run([*HARNESS, "--shell"], input='cat "$HOSTFILE"; ssh node2 hostname; exit\n',
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=environment(),
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "a shell on node1; exit it to tear the cluster down" in done.stdout
    assert "node1 slots=1\nnode2 slots=1\nnode2" in done.stdout
