"""Hostfile fuzzing: every field of valid hostfiles, in every accepted syntax, replaced by bad values.

Each mutated file either parses into sane nodes or raises LaunchError naming the file and line —
never another exception (a traceback from inside Python is a bug, whatever the input).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from spikingsail.errors import LaunchError
from spikingsail.launchers.hostfile import MAX_SLOTS, Node, parse_host_list, parse_hostfile

# Valid hostfiles as fields: a line is a list of words that are joined with the separator after
# each ("" at the end). DeepSpeed / Open MPI "slots=N", "slots = N", seed 000's "HOST N", bare
# hosts (with --nproc-per-node), comments and blank lines.
VALID: list[list[list[tuple[str, str]]]] = [
    [[("node1", " "), ("slots=", ""), ("4", "")], [("node2", " "), ("slots=", ""), ("4", "")]],
    [[("# the V100 boxes", "")], [("worker-1", " "), ("2", "  "), ("# two GPUs", "")], [("", "")],
     [("worker-2", "\t"), ("2", "")]],
    [[("10.0.0.1", " "), ("slots", " "), ("= ", ""), ("1", "")], [("gpu_07", "")], [("gpu_08", " "), ("3", "")]],
]  # fmt: skip
MUTATIONS = [
    "", " ", "0", "-1", "+1", "1.5", "1e3", "0x10", "four", "true", "[1]", "{}", "null", "None", "NaN",
    "inf", "99999999999999999999", "9" * 5000, str(MAX_SLOTS + 1), "²", "٣", "１", "nöde", "名前",
    "-oProxyCommand=touch X", "-v", "--", "-", "#", "=", "slots=", "slots==2", "a b", "a\tb", "\x00",
    "\x1b[31m", "\r", "\u2028", "$(touch X)", "`id`", "node1", "'quoted'", '"', "\\", "%s%n", "a" * 300,
    "host:2", "host,other", "@", "*",
]  # fmt: skip


def render(lines: list[list[tuple[str, str]]]) -> str:
    return "".join("".join(word + sep for word, sep in line) + "\n" for line in lines)


def mutants() -> list[tuple[int, str]]:
    out = []
    for index, lines in enumerate(VALID):
        for row, line in enumerate(lines):
            for column in range(len(line)):
                for value in MUTATIONS:
                    changed = [list(other) for other in lines]
                    changed[row][column] = (value, line[column][1])
                    out.append((index, render(changed)))
    return out


def outcome(parse: Callable[[], list[Node]]) -> list[Node] | str:
    """The nodes, or the LaunchError's message; any other exception fails the test."""
    try:
        return parse()
    except LaunchError as err:
        return str(err)


def check_nodes(nodes: list[Node], text: str) -> None:
    for node in nodes:
        assert re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*", node.host), (node, text)
        assert 1 <= node.nproc <= MAX_SLOTS and node.slots == tuple(range(node.nproc)), (node, text)


@pytest.mark.parametrize("default_slots", [None, 2])
def test_every_field_of_valid_hostfiles_mutated(tmp_path: Path, default_slots: int | None) -> None:
    path = tmp_path / "hostfile"
    cases = mutants()
    assert len(cases) >= 1000  # 20 fields × 50 values
    for _index, text in cases:
        path.write_bytes(text.encode(errors="surrogatepass"))
        result = outcome(lambda: parse_hostfile(path, default_slots=default_slots))
        if isinstance(result, str):
            # a line's error names the line; a file that lost all its hosts is named as a whole
            named = (
                re.search(rf"{re.escape(str(path))}:\d+: ", result)
                or f"hostfile {path} lists no hosts" in result
            )
            assert named, (text, result)
        else:
            check_nodes(result, text)


def test_bytes_that_are_not_text(tmp_path: Path) -> None:
    path = tmp_path / "hostfile"
    for raw in (
        b"node1 slots=\xff\n",
        b"\xfe\xff\x00n\x00o\n",
        b"node1 slots=2\n\x80\n",
        b"\xed\xa0\x80 slots=1\n",
    ):
        path.write_bytes(raw)
        with pytest.raises(LaunchError, match=rf"{re.escape(str(path))}:\d+: the line is not UTF-8 text"):
            parse_hostfile(path)


@pytest.mark.parametrize("value", MUTATIONS)
def test_host_list_fields_mutated(value: str) -> None:
    for spec in (f"{value}:2,node2:2", f"node1:{value},node2:2", f"node1:2,{value}", f"node1:2{value}"):
        result = outcome(lambda: parse_host_list(spec))  # noqa: B023 - called at once
        if isinstance(result, str):
            assert result.startswith("-H "), (spec, result)
        else:
            check_nodes(result, spec)
