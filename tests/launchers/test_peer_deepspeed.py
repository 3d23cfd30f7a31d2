"""Hostfiles and ``--include`` / ``--exclude`` against DeepSpeed's own launcher code on the same input: generated
host lists and filters, the hosts and slots SpikingSail runs on compared with what
``deepspeed.launcher.runner.parse_inclusion_exclusion`` returns, and a refusal where it raises."""

from __future__ import annotations

import collections
import logging

import pytest
from deepspeed.launcher.runner import parse_inclusion_exclusion
from hypothesis import example, given, settings
from hypothesis import strategies as st

from spikingsail.errors import LaunchError
from spikingsail.launchers.hostfile import Node, select_nodes

HOSTS = ["worker-0", "worker-1", "worker-2"]

pools = st.lists(st.sampled_from(HOSTS), min_size=1, max_size=3, unique=True).flatmap(
    lambda hosts: st.tuples(
        st.just(hosts), st.lists(st.integers(1, 4), min_size=len(hosts), max_size=len(hosts))
    )
)
entries = st.tuples(
    st.sampled_from([*HOSTS, "worker-9"]),  # one host no list has
    st.none() | st.lists(st.integers(0, 5), min_size=1, max_size=4),
).map(lambda e: e[0] if e[1] is None else f"{e[0]}:{','.join(map(str, e[1]))}")
filters = st.lists(entries, min_size=1, max_size=4).map("@".join)


def deepspeeds(pool: dict[str, int], include: str, exclude: str) -> dict[str, list[int]] | None:
    """DeepSpeed's hosts and slots, or None where it raises."""
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)  # its "removing slot" lines
    try:
        return dict(parse_inclusion_exclusion(collections.OrderedDict(pool), include, exclude))
    except ValueError:
        return None


def ours(pool: dict[str, int], include: str, exclude: str) -> dict[str, list[int]] | None:
    nodes = [Node(host=host, slots=tuple(range(slots))) for host, slots in pool.items()]
    try:
        chosen = select_nodes(nodes, include=include or None, exclude=exclude or None)
    except LaunchError as err:
        if "no node is left" in str(err):
            return {}  # DeepSpeed returns no host, and its launcher then fails; sail says why here
        return None
    return {node.host: list(node.slots) for node in chosen}


@given(pool=pools, spec=filters, include=st.booleans())
@example(pool=(["worker-0"], [4]), spec="worker-0:1,1", include=True)  # the cases
@example(pool=(["worker-0"], [4]), spec="worker-0:1@worker-0:2", include=True)
@example(pool=(["worker-0", "worker-1"], [4, 4]), spec="worker-1:4", include=False)
@example(pool=(["worker-0", "worker-1"], [4, 4]), spec="worker-1@worker-0:2,1", include=True)
@example(pool=(["worker-0"], [4]), spec="worker-0@worker-0:1", include=True)
@settings(max_examples=300, deadline=None)
def test_filters_choose_what_deepspeeds_launcher_chooses(
    pool: tuple[list[str], list[int]], spec: str, include: bool
) -> None:
    hosts = dict(zip(*pool, strict=True))
    include_str, exclude_str = (spec, "") if include else ("", spec)
    assert ours(hosts, include_str, exclude_str) == deepspeeds(hosts, include_str, exclude_str)


@pytest.mark.parametrize("spec", ["worker-0:", "@worker-0", "worker-0@@worker-1", "worker-0:a", ":1"])
def test_filters_deepspeed_cannot_read_are_refused_naming_the_flag(spec: str) -> None:
    pool = {"worker-0": 2, "worker-1": 2}
    assert deepspeeds(pool, spec, "") is None
    with pytest.raises(LaunchError, match="--include"):
        select_nodes([Node(host=h, slots=tuple(range(n))) for h, n in pool.items()], include=spec)


# -- hostfiles ----------------------------------------------------------------------------------

# (line, the deviations that may make SpikingSail's reading differ from DeepSpeed's)
hosts = st.sampled_from([("node1", ()), ("node-2", ()), ("n3.lab", ()), ("u@node4", ("hostfile-host-name",)),
                         ("-oX", ("hostfile-host-name",))])  # fmt: skip
counts = st.integers(0, 3).map(lambda n: (str(n), ("hostfile-zero-slots",) if n == 0 else ()))
tails = st.sampled_from([("", ()), (" # a comment", ()), (" extra", ("hostfile-trailing-text",)),
                         ("x", ("hostfile-trailing-text",))])  # fmt: skip


@st.composite
def hostfile_lines(draw: st.DrawFn) -> tuple[str, tuple[str, ...]]:
    host, why_host = draw(hosts)
    count, why_count = draw(counts)
    tail, why_tail = draw(tails)
    form = draw(st.sampled_from(["slots", "spaced", "count", "bare", "max", "comment", "blank"]))
    lead = draw(st.sampled_from(["", "  ", "\t"]))
    why = why_host + why_count + why_tail
    if form == "comment":
        return f"{lead}# {host} slots={count}", ()
    if form == "blank":
        return lead, ()
    if form == "bare":
        return f"{lead}{host}", (*why_host, "hostfile-bare-host")
    if form == "count":
        return f"{lead}{host} {count}{tail}", (*why, "hostfile-count")
    if form == "spaced":
        return f"{lead}{host} slots = {count}{tail}", (*why, "hostfile-spaced")
    if form == "max":
        most = draw(st.integers(0, 4))
        return f"{lead}{host} slots={count} max_slots={most}{tail}", (*why, "hostfile-max-slots")
    return f"{lead}{host}\tslots={count}{tail}" if lead == "\t" else f"{lead}{host} slots={count}{tail}", why


def deepspeeds_hostfile(lines: list[str]) -> dict[str, int] | None:
    from deepspeed.launcher.runner import _parse_hostfile

    logging.getLogger("DeepSpeed").setLevel(logging.CRITICAL)  # its "bad hostfile" lines
    try:
        return dict(_parse_hostfile(lines))
    except ValueError:
        return None


@given(lines=st.lists(hostfile_lines(), min_size=1, max_size=4), nproc=st.none() | st.integers(1, 3))
@example(
    lines=[("node1", ("hostfile-bare-host",))], nproc=None
)  # the 'missingslots': refused by both
@settings(max_examples=300, deadline=None)
def test_hostfiles_read_as_deepspeeds_launcher_reads_them(
    tmp_path_factory: pytest.TempPathFactory, lines: list[tuple[str, tuple[str, ...]]], nproc: int | None
) -> None:
    from spikingsail.launchers.deviations import DEVIATIONS
    from spikingsail.launchers.hostfile import parse_hostfile

    def mine(text: list[str]) -> dict[str, int] | None:
        path = tmp_path_factory.mktemp("hostfile") / "hostfile"
        path.write_text("\n".join(text) + "\n")
        try:
            return {n.host: n.nproc for n in parse_hostfile(path, default_slots=nproc)}
        except LaunchError:
            return None

    text = [line for line, _ in lines]
    allowed = {why for _, whys in lines for why in whys}
    assert allowed <= DEVIATIONS.keys()
    if mine(text) != deepspeeds_hostfile(text):
        assert allowed, (
            f"{text}: DeepSpeed {deepspeeds_hostfile(text)}, SpikingSail {mine(text)}, undocumented"
        )
    plain = [line for line, whys in lines if not whys]  # without the lines read differently on purpose
    assert mine(plain) == deepspeeds_hostfile(plain), plain
