"""The flags DeepSpeed's and horovodrun's users already type, read as those launchers read them."""

from __future__ import annotations

from pathlib import Path

import pytest

from spikingsail.errors import LaunchError
from spikingsail.launchers.hostfile import Node
from spikingsail.launchers.request import parse_request
from tests.launchers.plans import plan


@pytest.mark.parametrize(
    ("argv", "nodes"),
    [
        (["-i", "node2:1"], [Node(host="node2", slots=(1,))]),
        (["-inode2:1"], [Node(host="node2", slots=(1,))]),
        (["-e", "node1"], [Node(host="node2", slots=(0, 1))]),
        (["--num_accelerators", "1"], [Node(host="node1", slots=(0,)), Node(host="node2", slots=(0,))]),
    ],
)
def test_deepspeeds_short_flags_and_aliases(job: Path, argv: list[str], nodes: list[Node]) -> None:
    assert parse_request(["-H", "hostfile", *argv, "train.py"]).nodes == nodes


def test_deepspeeds_ssh_port_spelling(job: Path) -> None:
    command = plan(parse_request(["-H", "hostfile", "--ssh_port", "222", "train.py"]))[0]
    assert command.argv[command.argv.index("-p") + 1] == "222"


def test_launcher_args_starting_with_a_dash_reach_the_launcher_and_the_scripts_own_stay(job: Path) -> None:
    """DeepSpeed's `--launcher_args '-mca btl_tcp_if_include eth1'`: argparse alone reads `-mca` as
    torchrun's `-m`. The script's own arguments of that name reach it as written."""
    request = parse_request(
        ["-H", "hostfile", "--launcher", "mpirun", "--launcher_args", "-mca btl_tcp_if_include eth1",
         "train.py", "--launcher_args", "-x"]
    )  # fmt: skip
    assert request.launcher_args == ["-mca", "btl_tcp_if_include", "eth1"]
    assert request.script_args == ["--launcher_args", "-x"]
    assert "btl_tcp_if_include" in plan(request)[0].argv


@pytest.mark.parametrize(
    "hosts", [["-hostfile", "hostfile"], ["--hostfile", "hostfile"], ["--hosts", "node1:2,node2:2"]]
)
@pytest.mark.parametrize("np", [["-np", "3"], ["--num-proc", "3"]])
def test_horovodruns_spellings(job: Path, hosts: list[str], np: list[str]) -> None:
    request = parse_request(["--launcher", "horovodrun", *hosts, *np, "train.py"])
    assert request.nodes == [Node(host="node1", slots=(0, 1)), Node(host="node2", slots=(0,))]
    assert request.world_size == 3


@pytest.mark.parametrize("launcher", [[], ["--launcher", "local"]])
def test_np_without_hosts_runs_here_as_horovodrun_does(job: Path, launcher: list[str]) -> None:
    request = parse_request([*launcher, "-np", "3", "train.py"])
    assert request.nodes is None and request.nproc_per_node == "3" and request.world_size == 3
    assert (
        "--nproc-per-node" in (argv := plan(request)[0].argv)
        and argv[argv.index("--nproc-per-node") + 1] == "3"
    )


def test_np_and_nproc_per_node_without_hosts_are_one_too_many(job: Path) -> None:
    with pytest.raises(LaunchError, match="-np and --nproc-per-node were both given") as err:
        parse_request(["-np", "2", "-n", "2", "train.py"])
    assert "as horovodrun does" in str(err.value)


def test_a_filter_without_hosts_names_its_flag(job: Path) -> None:
    with pytest.raises(LaunchError, match=r"^--num_gpus needs hosts"):
        parse_request(["--num_gpus", "2", "train.py"])
