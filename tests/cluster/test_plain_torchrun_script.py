"""A plain torchrun script (no SpikingSail API) runs under every `sail launch` path the engine runs under."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster.harness import NamespaceCluster
from tests.cluster.test_mpirun import MCA
from tests.cluster.test_ssh_pdsh import SAIL, assert_no_job_left, hostfile

pytestmark = pytest.mark.cluster
PLAIN = Path(__file__).with_name("jobs") / "plain_ddp.py"


def check_two_ranks(tmp_path: Path) -> None:
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("rank*.json"))]
    assert [(r["rank"], r["host"], r["world_size"], r["local_rank"]) for r in records] == [
        (0, "node1", 2, 0),
        (1, "node2", 2, 0),
    ]
    assert records[0]["digest"] == records[1]["digest"]


@pytest.mark.parametrize(
    "flags",
    [
        ["--launcher", "ssh"],
        ["--launcher", "pdsh"],
        ["--launcher", "mpirun", "--launcher-args", MCA, "--master-port", "29633"],
    ],
    ids=["ssh", "pdsh", "mpirun"],
)
def test_plain_script_over_a_hostfile(slurm: NamespaceCluster, tmp_path: Path, flags: list[str]) -> None:
    argv = [*SAIL, "-H", str(hostfile(tmp_path)), "--ssh-config", str(slurm.ssh_config), *flags,
            str(PLAIN), str(tmp_path / "out")]  # fmt: skip
    result = slurm.run("node1", argv, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check_two_ranks(tmp_path)
    assert_no_job_left(slurm)


@pytest.mark.parametrize("mode", ["torchrun", "slurm"])
def test_plain_script_under_slurm(slurm: NamespaceCluster, tmp_path: Path, mode: str) -> None:
    argv = ["salloc", "-N", "2", "--ntasks-per-node", "1", *SAIL, "--dist-init-method", mode,
            str(PLAIN), str(tmp_path / "out")]  # fmt: skip
    result = slurm.run("node1", argv, cwd=tmp_path, env=slurm.slurm_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check_two_ranks(tmp_path)
    assert_no_job_left(slurm)
