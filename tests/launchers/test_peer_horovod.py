"""horovodrun's ``-H`` host lists, ``-hostfile`` files and ``-np`` against Horovod's own code on the
same input: generated host lists and hostfiles, the processes SpikingSail starts on each host compared with what
``horovod.runner.common.util.hosts`` assigns, and a refusal where it raises."""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from spikingsail.errors import LaunchError
from spikingsail.launchers.deviations import DEVIATIONS
from spikingsail.launchers.hostfile import Node, distribute, parse_host_list, parse_hostfile

# (entry, the deviations that may make SpikingSail's reading differ from horovodrun's)
slots = st.sampled_from(
    [("1", ()), ("2", ()), ("4", ()), ("0", ("hosts-zero-slots",)), ("+2", ("hosts-slot-spelling",)),
     (" 2", ()), ("x", ())]
)  # fmt: skip
entries = st.tuples(st.sampled_from(["node1", "node2", "10.0.0.3", ""]), st.none() | slots).map(
    lambda e: (
        (e[0], ("hosts-bare",) if e[0] else ())
        if e[1] is None
        else (f"{e[0]}:{e[1][0]}", e[1][1] + (() if e[0] else ("hosts-host-name",)))
    )
)


def horovods(spec: str, np: int) -> dict[str, int] | None:
    # imported here, not at collection: scripts/test.sh may be building Horovod (tests/horovod_build.py)
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    try:
        assigned = get_host_assignments(parse_hosts(spec), np, np)
    except ValueError:
        return None
    return dict(collections.Counter(slot.hostname for slot in assigned))


def ours(read: Callable[[], list[Node]], np: int) -> dict[str, int] | None:
    """What SpikingSail starts on each host of the nodes ``read()`` gives, or None where it refuses."""
    try:
        return {node.host: node.nproc for node in distribute(read(), np)}
    except LaunchError:
        return None


def same_or_deviation(given: str, np: int, sail: Any, peer: Any, whys: set[str], hosts: list[str]) -> None:
    """Both readings agree, unless a documented deviation (of ``whys``, or a host given twice) is in play."""
    allowed = whys | ({"hosts-repeated"} if len(set(hosts)) < len(hosts) else set())
    assert allowed <= DEVIATIONS.keys()
    if sail != peer:
        assert allowed, f"{given} -np {np}: horovodrun {peer}, SpikingSail {sail}"


@given(items=st.lists(entries, min_size=1, max_size=4), np=st.integers(1, 9))
@example(items=[("node1:2", ()), ("node2:2", ())], np=3)
@example(items=[("node1:2", ()), ("", ()), ("node2:2", ())], np=2)  # an empty entry: both refuse
@settings(max_examples=300, deadline=None)
def test_host_lists_start_what_horovodrun_starts(items: list[tuple[str, tuple[str, ...]]], np: int) -> None:
    spec = ",".join(item for item, _ in items)
    hosts = [item.partition(":")[0].strip() for item, _ in items]
    whys = {why for _, reasons in items for why in reasons}
    same_or_deviation(
        f"-H {spec!r}", np, ours(lambda: parse_host_list(spec), np), horovods(spec, np), whys, hosts
    )


# (hostfile line, the deviations that may make SpikingSail's reading differ from horovodrun's)
lines = st.sampled_from([
    ("node1 slots=2", ()), ("node2 slots=1", ()), ("10.0.0.3 slots=4", ()), ("node1 slots=2   ", ()),
    ("node3\tslots=3", ()), ("node2 slots=0", ("hosts-zero-slots",)), ("node2 slots=+2", ("hosts-slot-spelling",)),
    ("# a comment", ("hostfile-blank-and-comment-lines",)), ("", ("hostfile-blank-and-comment-lines",)),
    ("node1", ()),  # no slot count: horovodrun fails on it, SpikingSail refuses it (without -n)
])  # fmt: skip


def horovods_hostfile(path: Path, np: int) -> dict[str, int] | None:
    """What horovodrun -hostfile PATH -np NP starts on each host: its hostfile becomes a -H host list."""
    from horovod.runner.common.util.hosts import parse_host_files

    try:
        spec = parse_host_files(str(path))
    except (IndexError, ValueError):  # a line without `=`
        return None
    return horovods(spec, np)


@given(items=st.lists(lines, min_size=1, max_size=4), np=st.integers(1, 9))
@example(items=[("node1 slots=2", ()), ("node2 slots=2", ())], np=3)
@settings(max_examples=200, deadline=None)
def test_hostfiles_start_what_horovodrun_starts(
    tmp_path_factory: pytest.TempPathFactory, items: list[tuple[str, tuple[str, ...]]], np: int
) -> None:
    path = tmp_path_factory.mktemp("hostfile") / "hostfile"
    path.write_text("".join(f"{line}\n" for line, _ in items))
    hosts = [line.split()[0] for line, _ in items if line and not line.startswith("#")]
    whys = {why for _, reasons in items for why in reasons}
    same_or_deviation(repr(path.read_text()), np, ours(lambda: parse_hostfile(path), np),
                      horovods_hostfile(path, np), whys, hosts)  # fmt: skip
