"""Multi-node plans as data: the exact per-node commands and environment, before anything runs."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from spikingsail.errors import LaunchError
from spikingsail.launchers import plan
from spikingsail.launchers.remote_env import read_env_file, remote_env
from spikingsail.launchers.request import FORWARDED_SIGNALS, parse_request


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").touch()
    (tmp_path / "hostfile").write_text("node1 slots=2\nnode2 slots=2\n")
    return tmp_path


def setenv(monkeypatch: pytest.MonkeyPatch, variables: dict[str, str]) -> None:
    for key, value in variables.items():
        monkeypatch.setenv(key, value)


def remote(argv: list[str]) -> list[str]:
    return shlex.split(argv[-1])


def test_ssh_plan_one_agent_per_node(job: Path) -> None:
    commands = plan(
        parse_request(
            [
                "-H",
                "hostfile",
                "--ssh-port",
                "222",
                "--max-restarts",
                "2",
                "--rdzv-id",
                "job7",
                "train.py",
                "--lr",
                "0.1",
            ]
        )
    )
    assert [c.host for c in commands] == ["node1", "node2"]
    for command in commands:
        assert command.argv[:2] == ["ssh", "-tt"]
        assert {"BatchMode=yes", "ConnectTimeout=10"} <= set(command.argv)
        assert command.argv[command.argv.index("-p") + 1] == "222"
        words = remote(command.argv)
        assert words[:3] == ["cd", str(job), "&&"]
        agent = words[words.index(sys.executable) :]
        assert agent == [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "node1:29500",
            "--rdzv-id",
            "job7",
            "--max-restarts",
            "2",
            "--signals-to-handle",
            FORWARDED_SIGNALS,
            "train.py",
            "--lr",
            "0.1",
        ]


def test_include_slots_become_cuda_visible_devices(job: Path) -> None:
    (node,) = plan(parse_request(["-H", "hostfile", "--include", "node2:1", "train.py"]))
    words = remote(node.argv)
    assert node.host == "node2"
    assert "CUDA_VISIBLE_DEVICES=1" in words
    assert words[words.index("--nnodes") + 1] == "1" and words[words.index("--nproc-per-node") + 1] == "1"
    assert words[words.index("--rdzv-endpoint") + 1] == "node2:29500"


def test_horovod_style_host_list_and_np(job: Path) -> None:
    commands = plan(parse_request(["-H", "a:2,b:2,c:2", "-np", "3", "train.py"]))
    assert [(c.host, remote(c.argv)[remote(c.argv).index("--nproc-per-node") + 1]) for c in commands] == [
        ("a", "2"),
        ("b", "1"),
    ]


def test_pdsh_groups_nodes_and_returns_remote_failures(job: Path) -> None:
    (command,) = plan(
        parse_request(["-H", "hostfile", "--launcher", "pdsh", "--ssh-config", "cfg", "train.py"])
    )
    assert command.argv[:6] == ["pdsh", "-S", "-f", "1024", "-w", "node1,node2"]
    assert command.env["PDSH_RCMD_TYPE"] == "ssh"
    assert "-F cfg" in command.env["PDSH_SSH_ARGS_APPEND"] and "-tt" in command.env["PDSH_SSH_ARGS_APPEND"]


def test_environment_shipped_is_explicit(job: Path) -> None:
    (job / ".sail_env").write_text(
        "# cluster settings\nNCCL_SOCKET_IFNAME=eth0\nexport GLOO_SOCKET_IFNAME='eth0'\n"
    )
    shell = {"NCCL_DEBUG": "INFO", "AWS_SECRET_ACCESS_KEY": "s3cr3t", "HOME": "/root", "OMP_NUM_THREADS": "4"}
    env = remote_env({"NCCL_DEBUG": "WARN"}, shell=shell, search=(job / ".sail_env",))
    assert env == {
        "NCCL_DEBUG": "WARN",
        "OMP_NUM_THREADS": "4",
        "NCCL_SOCKET_IFNAME": "eth0",
        "GLOO_SOCKET_IFNAME": "eth0",
    }


def test_bad_env_file_line_and_flag(job: Path) -> None:
    (job / ".sail_env").write_text("A=1\nnot an assignment\n")
    with pytest.raises(LaunchError, match=r"\.sail_env:2: cannot read 'not an assignment'"):
        read_env_file(job / ".sail_env")
    with pytest.raises(LaunchError, match="--env 'NOEQUALS' is not KEY=VALUE"):
        parse_request(["-H", "hostfile", "--env", "NOEQUALS", "train.py"])


def test_flags_that_need_hosts(job: Path) -> None:
    with pytest.raises(LaunchError, match="--include needs hosts"):
        parse_request(["--include", "node1", "train.py"])
    with pytest.raises(LaunchError, match="-H nohostfile: no such hostfile"):
        parse_request(["-H", "nohostfile", "train.py"])


PLATFORM = {"MASTER_ADDR": "10.1.0.7", "MASTER_PORT": "23456", "RANK": "1", "WORLD_SIZE": "3"}


def test_platform_variables_make_this_node_rank_of_world_size(
    job: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    setenv(monkeypatch, PLATFORM)
    request = parse_request(["--nproc-per-node", "4", "train.py"])
    assert request.torchrun_args == [
        "--nnodes",
        "3",
        "--node-rank",
        "1",
        "--master-addr",
        "10.1.0.7",
        "--master-port",
        "23456",
        "--nproc-per-node",
        "4",
        "--signals-to-handle",
        FORWARDED_SIGNALS,
    ]


def test_standalone_ignores_platform_variables(job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, PLATFORM)
    assert parse_request(["--standalone", "-n", "2", "train.py"]).torchrun_args == [
        "--nproc-per-node",
        "2",
        "--standalone",
        "--signals-to-handle",
        FORWARDED_SIGNALS,
    ]


def test_bad_platform_node_rank(job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, {**PLATFORM, "RANK": "3"})
    with pytest.raises(LaunchError, match="node RANK=3 of WORLD_SIZE=3"):
        parse_request(["train.py"])


ALLOCATION = {
    "SLURM_JOB_ID": "77",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_GPUS_ON_NODE": "4",
}


def test_inside_an_allocation_srun_starts_one_agent_per_node(
    job: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    setenv(monkeypatch, ALLOCATION)
    (command,) = plan(parse_request(["--max-restarts", "1", "train.py", "--epochs", "3"]))
    assert command.argv == [
        "srun",
        "--nodes",
        "2",
        "--ntasks-per-node",
        "1",
        "--kill-on-bad-exit=1",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "gpu07:29500",
        "--rdzv-id",
        "77",
        "--max-restarts",
        "1",
        "--signals-to-handle",
        FORWARDED_SIGNALS,
        "train.py",
        "--epochs",
        "3",
    ]


def test_dist_init_slurm_starts_one_task_per_process(job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, ALLOCATION)
    (command,) = plan(parse_request(["--dist-init-method", "slurm", "--nproc-per-node", "2", "train.py"]))
    assert command.argv == [
        "srun",
        "--nodes",
        "2",
        "--ntasks-per-node",
        "2",
        "--kill-on-bad-exit=1",
        sys.executable,
        "-u",
        "-m",
        "spikingsail.launchers.as_torchrun",
        "train.py",
    ]


def test_slurm_launcher_outside_an_allocation(job: Path) -> None:
    with pytest.raises(LaunchError, match="--launcher slurm outside a SLURM allocation"):
        parse_request(["--launcher", "slurm", "train.py"])
