"""Hostfiles and host lists in the forms DeepSpeed, Open MPI, horovodrun and seed 000 use."""

from __future__ import annotations

from pathlib import Path

import pytest

from spikingsail.errors import LaunchError
from spikingsail.launchers.hostfile import Node, distribute, parse_host_list, parse_hostfile, select_nodes


def hostfile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


def test_deepspeed_and_seed_forms_with_comments(tmp_path: Path) -> None:
    path = hostfile(
        tmp_path, "# cluster\nworker-1 slots=4\n\nworker-2  2   # the V100 box\n10.0.0.3 slots = 1\n"
    )
    assert parse_hostfile(path) == [
        Node(host="worker-1", slots=(0, 1, 2, 3)),
        Node(host="worker-2", slots=(0, 1)),
        Node(host="10.0.0.3", slots=(0,)),
    ]


def test_bare_host_takes_nproc_per_node(tmp_path: Path) -> None:
    path = hostfile(tmp_path, "node1\nnode2 slots=1\n")
    assert [n.nproc for n in parse_hostfile(path, default_slots=2)] == [2, 1]
    with pytest.raises(LaunchError, match=r"hostfile:1: no slot count"):
        parse_hostfile(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "node1 slots=4\nnode2 slots=four\n",
            r"hostfile:2: slot count 'four' is not an integer from 1 to 4096",
        ),
        ("node1 slots=4\nnode2 slots=0\n", r"hostfile:2: slot count '0'"),
        (
            "node1 slots=99999999999999999999\n",
            r"hostfile:1: slot count '99999999999999999999' is not an integer",
        ),
        ("node1 slots=²\n", r"hostfile:1: slot count '²' is not an integer"),
        (
            "node1 slots=1\n-v slots=1\n",
            r"hostfile:2: '-v' is not a host name\n  why: a name starting with '-'",
        ),
        ("node1 slots=1\nnöde slots=1\n", r"hostfile:2: 'nöde' is not a host name"),
        ("node1 slots=4 extra\n", r"hostfile:1: cannot read 'node1 slots=4 extra'"),
        ("node1 slots=2\nnode1 slots=2\n", r"hostfile:2: host node1 is listed again \(first on line 1\)"),
        ("# nothing\n\n", r"lists no hosts"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        parse_hostfile(hostfile(tmp_path, text))


def test_missing_hostfile(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="cannot read hostfile"):
        parse_hostfile(tmp_path / "nope")


def test_horovod_host_list() -> None:
    assert parse_host_list("h1:2,h2:1,h3") == [
        Node(host="h1", slots=(0, 1)),
        Node(host="h2", slots=(0,)),
        Node(host="h3", slots=(0,)),
    ]
    with pytest.raises(LaunchError, match="'h2:x': slot count 'x' is not an integer from 1 to 4096"):
        parse_host_list("h1:2,h2:x")


def test_a_host_starting_with_a_dash_is_refused_where_it_is_read(tmp_path: Path) -> None:
    with pytest.raises(
        LaunchError, match=r"-H '-oProxyCommand=touch X:1': '-oProxyCommand=touch X' is not a host"
    ):
        parse_host_list("-oProxyCommand=touch X:1")
    path = tmp_path / "hostfile"
    path.write_bytes(b"node1 slots=1\n-oProxyCommand=touch slots=1\n")
    with pytest.raises(LaunchError, match=r"hostfile:2: '-oProxyCommand=touch' is not a host name"):
        parse_hostfile(path)


def test_a_line_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "hostfile"
    path.write_bytes(b"node1 slots=1\nnode2 slots=\xff\n")
    with pytest.raises(LaunchError, match=r"hostfile:2: the line is not UTF-8 text \(byte 13\)"):
        parse_hostfile(path)


NODES = [Node(host="a", slots=(0, 1, 2, 3)), Node(host="b", slots=(0, 1, 2, 3)), Node(host="c", slots=(0, 1))]


def test_include_hosts_and_slots() -> None:
    """As DeepSpeed's launcher: the hosts in the host list's order, a host's entries merged."""
    assert select_nodes(NODES, include="b:3,1@a") == [
        Node(host="a", slots=(0, 1, 2, 3)),
        Node(host="b", slots=(1, 3)),
    ]
    assert select_nodes(NODES, include="a:1,1") == [Node(host="a", slots=(1,))]
    assert select_nodes(NODES, include="a:1@a:2") == [Node(host="a", slots=(1, 2))]


def test_exclude_hosts_and_slots() -> None:
    assert select_nodes(NODES, exclude="a@b:0") == [
        Node(host="b", slots=(1, 2, 3)),
        Node(host="c", slots=(0, 1)),
    ]


def test_include_of_an_unknown_host_names_it() -> None:
    with pytest.raises(LaunchError, match="--include names host d, which is not in the host list") as err:
        select_nodes(NODES, include="a@d")
    assert "hosts available: a, b, c" in str(err.value)


def test_a_filter_naming_a_slot_the_host_lacks_is_refused() -> None:
    with pytest.raises(LaunchError, match=r"--include names slot\(s\) \[2\] of c"):
        select_nodes(NODES, include="c:1,2")
    with pytest.raises(LaunchError, match=r"--exclude names slot\(s\) \[4\] of b"):
        select_nodes(NODES, exclude="b:4")


def test_num_nodes_and_num_gpus() -> None:
    assert select_nodes(NODES, num_nodes=2, num_gpus=2) == [
        Node(host="a", slots=(0, 1)),
        Node(host="b", slots=(0, 1)),
    ]
    with pytest.raises(LaunchError, match="--num_nodes 4 but 3 node"):
        select_nodes(NODES, num_nodes=4)
    with pytest.raises(LaunchError, match="--num_gpus 3 is more than the slots of c"):
        select_nodes(NODES, num_gpus=3)


def test_horovod_np_fills_hosts_in_order() -> None:
    assert distribute(NODES, 6) == [Node(host="a", slots=(0, 1, 2, 3)), Node(host="b", slots=(0, 1))]
    with pytest.raises(LaunchError, match="-np 11 but the hosts offer 10 slot"):
        distribute(NODES, 11)
