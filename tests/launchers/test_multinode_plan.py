"""Multi-node plans as data: the exact per-node commands and environment, before anything runs."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from spikingsail.errors import LaunchError
from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.preflight import check_hosts
from spikingsail.launchers.request import FORWARDED_SIGNALS, SSHOptions, parse_request
from tests.launchers.plans import plan


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
        # ssh reads no option after "--": whatever the host's name, it is a host
        for argv in (command.argv, command.cleanup, command.relay):
            assert argv is not None and argv[argv.index("--") + 1] == command.host, argv
        assert command.uploads == []  # nothing to ship
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
    assert [u.env for u in node.uploads] == [{"CUDA_VISIBLE_DEVICES": "1"}]
    assert words[words.index("--nnodes") + 1] == "1" and words[words.index("--nproc-per-node") + 1] == "1"
    assert words[words.index("--rdzv-endpoint") + 1] == "node2:29500"


def test_horovod_style_host_list_and_np(job: Path) -> None:
    commands = plan(parse_request(["-H", "a:2,b:2,c:2", "-np", "3", "train.py"]))
    assert [(c.host, remote(c.argv)[remote(c.argv).index("--nproc-per-node") + 1]) for c in commands] == [
        ("a", "2"),
        ("b", "1"),
    ]


def test_pdsh_groups_nodes_and_returns_remote_failures(job: Path) -> None:
    (job / "cfg").touch()  # ssh reads it on this machine: sail launch refuses one it cannot read
    (command,) = plan(
        parse_request(["-H", "hostfile", "--launcher", "pdsh", "--ssh-config", "cfg", "train.py"])
    )
    assert command.argv[:6] == ["pdsh", "-S", "-f", "1024", "-w", "node1,node2"]
    assert command.env["PDSH_RCMD_TYPE"] == "ssh"
    assert "-F cfg" in command.env["PDSH_SSH_ARGS_APPEND"] and "-tt" in command.env["PDSH_SSH_ARGS_APPEND"]


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
    run_id = command.argv[command.argv.index("--rdzv-id") + 1]
    assert run_id.startswith("77-") and len(run_id) == len("77-") + 8
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
        "gpu07:15077",  # 15000 + job id mod 15000, as for srun tasks
        "--rdzv-id",
        run_id,
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


def rendezvous(command: LaunchCommand) -> tuple[str, str]:
    argv = command.argv
    return argv[argv.index("--rdzv-endpoint") + 1], argv[argv.index("--rdzv-id") + 1]


def test_two_slurm_jobs_meet_at_their_own_port_under_their_own_id(
    job: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = []
    for job_id in ("77", "78"):
        setenv(monkeypatch, {**ALLOCATION, "SLURM_JOB_ID": job_id})
        (command,) = plan(parse_request(["train.py"]))
        seen.append(rendezvous(command))
    assert seen[0][0] == "gpu07:15077" and seen[1][0] == "gpu07:15078"
    assert seen[0][1].startswith("77-") and seen[1][1].startswith("78-")
    # the user's own choice stands
    (command,) = plan(parse_request(["--master-port", "29555", "--rdzv-id", "mine", "train.py"]))
    assert rendezvous(command) == ("gpu07:29555", "mine")


def test_a_taken_port_on_this_first_node_is_passed_over(job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside an sbatch script the first node is this machine: a port in use there is skipped."""
    with socket.socket() as taken:
        for job_id in range(4000, 4100):
            try:
                taken.bind(("", 15000 + job_id))
            except OSError:
                continue
            break
        taken.listen()
        setenv(monkeypatch, {**ALLOCATION, "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "localhost"})
        (command,) = plan(parse_request(["train.py"]))
    host, port = rendezvous(command)[0].split(":")
    assert host == "localhost" and 15000 + job_id < int(port) < 15000 + job_id + 64


SAIL = [sys.executable, "-m", "spikingsail.cli.main", "launch"]


def test_a_host_name_that_is_an_ssh_option_starts_nothing(job: Path) -> None:
    """The payload of a ProxyCommand host name, through the whole of `sail launch` (preflight included)."""
    payload = job / "pwned"
    (job / "dashed").write_text(f"node1 slots=1\n-oProxyCommand=touch\t{payload} slots=1\n")
    cases = {f"-oProxyCommand=touch {payload}:1": f"-H '-oProxyCommand=touch {payload}:1'",
             "dashed": "dashed:2: '-oProxyCommand=touch' is not a host name"}  # fmt: skip
    for spec, where in cases.items():
        done = subprocess.run(
            [*SAIL, "-H", spec, "train.py"], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 2, done.stderr
        assert where in done.stderr and "a name starting with '-' would reach ssh" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        assert not payload.exists()


def test_ssh_reads_a_host_name_as_a_host_even_if_it_starts_with_a_dash(job: Path) -> None:
    payload = job / "pwned"
    argv = SSHOptions(connect_timeout=2).command(f"-oProxyCommand=touch {payload}", "true")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 255 and not payload.exists()
    with pytest.raises(LaunchError, match="cannot reach 1 of 1 host"):
        check_hosts([f"-oProxyCommand=touch {payload}"], SSHOptions(connect_timeout=2))
    assert not payload.exists()


def test_only_ss_lines_of_a_listener_on_the_port_count_as_taken() -> None:
    from spikingsail.launchers.preflight import _is_listener

    assert _is_listener(
        'LISTEN 0      4096         0.0.0.0:29500      0.0.0.0:* users:(("python",pid=7,fd=3))', 29500
    )
    assert _is_listener("LISTEN 0      4096            [::]:29500         [::]:*", 29500)
    assert not _is_listener("LISTEN 0      4096         0.0.0.0:129500      0.0.0.0:*", 29500)
    assert not _is_listener("Welcome to node1: 29500 jobs served", 29500)  # a login banner
    assert not _is_listener("", 29500)


@pytest.mark.parametrize(
    ("variables", "per_node"),
    [
        ({"SLURM_GPUS_ON_NODE": "4"}, "4"),
        # salloc --ntasks-per-node=4 --gpus-per-task=1: four GPUs a node, one per task
        ({"SLURM_GPUS_PER_TASK": "1", "SLURM_NTASKS_PER_NODE": "4"}, "4"),
        ({"SLURM_GPUS_PER_TASK": "2"}, "2"),
        ({"SLURM_GPUS_PER_NODE": "a100:8"}, "8"),
        ({}, "1"),
    ],
)
def test_processes_per_node_inside_an_allocation_are_its_gpus_per_node(
    job: Path, monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], per_node: str
) -> None:
    allocation = {k: v for k, v in ALLOCATION.items() if k != "SLURM_GPUS_ON_NODE"}
    setenv(monkeypatch, {**allocation, **variables})
    (command,) = plan(parse_request(["train.py"]))
    assert command.argv[command.argv.index("--nproc-per-node") + 1] == per_node


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
def test_replica_groups_over_hosts_only_with_a_launcher_that_hosts_them(job: Path, launcher: str) -> None:
    from spikingsail.launchers.replicas import ReplicaPlan, plan_replica_groups

    request = parse_request(["-H", "hostfile", "--launcher", launcher, "--ft-replicas", "2", "train.py"])
    replicas = ReplicaPlan(groups=2, heartbeat_timeout_ms=1000, join_timeout_ms=10000, lighthouse_port=29999,
                           lighthouse_host="10.0.0.1")  # fmt: skip
    with pytest.raises(LaunchError) as refused:
        plan_replica_groups(request, replicas)
    assert str(refused.value).splitlines() == [
        f"--ft-replicas with --launcher {launcher}",
        "  why: each replica group runs under torchrun agents of its own, which sail launch starts on the "
        "group's nodes over ssh or pdsh",  # the launchers whose hosts_replica_groups is set
        "  fix: use --launcher ssh or --launcher pdsh (ssh is the default with -H)",
    ]
    for hosting in ("ssh", "pdsh"):
        allowed = parse_request(["-H", "hostfile", "--launcher", hosting, "--ft-replicas", "2", "train.py"])
        assert len(plan_replica_groups(allowed, replicas)) == 3  # the lighthouse and a sail launch per group
