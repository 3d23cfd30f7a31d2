"""Which hosts a job runs on, and which slots (GPUs) of each: hostfiles and host lists.

Accepted forms, as the tools users come from write them:

- DeepSpeed / Open MPI hostfile lines ``worker-1 slots=4``, and seed 000's ``worker-1 4``;
  ``#`` starts a comment, blank lines are ignored, a bare host name takes ``--nproc-per-node``.
- horovodrun's ``-H h1:2,h2:2``.
- DeepSpeed's ``--include`` / ``--exclude``: ``host[:slot,slot][@host[:slot,...]]``.
"""

from __future__ import annotations

import contextlib
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from spikingsail.errors import LaunchError

# A host name as ssh, pdsh and mpirun receive it: never starting with '-', which they would read as
# an option (``-oProxyCommand=...`` runs a command), and nothing a shell or a host list would split.
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
# What may follow the host on a hostfile line: ``slots=N`` (DeepSpeed, Open MPI) or seed 000's ``N``.
_SLOTS = re.compile(r"(?:slots\s*=\s*)?(?P<slots>\S+)")
_COUNT = re.compile(r"[0-9]{1,7}")
MAX_SLOTS = 4096
"""More processes than any node runs; a larger count is a typo, not a machine."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Node:
    host: str
    slots: tuple[int, ...]
    """The slot (GPU) indices this job uses on the host."""

    @property
    def nproc(self) -> int:
        return len(self.slots)


def parse_hostfile(path: str | Path, default_slots: int | None = None) -> list[Node]:
    """Read a hostfile; a bad line is an error naming the file and line."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise LaunchError(
            f"cannot read hostfile {path}",
            err.strerror or str(err),
            "check the path given to -H / --hostfile",
        ) from None
    nodes: list[Node] = []
    seen: dict[str, int] = {}
    # split on newlines only, so that line numbers are the ones an editor shows
    for number, raw_bytes in enumerate(data.split(b"\n"), start=1):
        where = f"{path}:{number}"
        raw = _decode(raw_bytes, where)
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, *more = line.split(None, 1)
        check_host(host, where)
        rest = more[0] if more else ""
        match = _SLOTS.fullmatch(rest) if rest else None
        if rest and match is None:
            raise LaunchError(
                f"{where}: cannot read {raw.strip()!r}",
                "a hostfile line is 'HOST slots=N' (DeepSpeed, Open MPI) or 'HOST N'",
                "fix or comment out that line",
            )
        if host in seen:
            raise LaunchError(
                f"{where}: host {host} is listed again (first on line {seen[host]})",
                "each host gets one line with all its slots",
                "merge the two lines",
            )
        seen[host] = number
        slots = _slot_count(match["slots"] if match else None, default_slots, where)
        nodes.append(Node(host=host, slots=tuple(range(slots))))
    if not nodes:
        raise LaunchError(f"hostfile {path} lists no hosts", fix="add one 'HOST slots=N' line per node")
    return nodes


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode().rstrip("\r")
    except UnicodeDecodeError as err:
        raise LaunchError(
            f"{where}: the line is not UTF-8 text (byte {err.start + 1})",
            "a hostfile is plain text: 'HOST slots=N' lines",
            "retype that line, or check that -H names the hostfile and not another file",
        ) from None


def check_host(host: str, where: str) -> str:
    """A host name from a hostfile or a host list, or an error naming where it came from."""
    if _HOST.fullmatch(host):
        return host
    if host.startswith("-"):
        why = "a name starting with '-' would reach ssh, pdsh and mpirun as an option, not as a host"
    else:
        why = "a host name has only letters, digits, '.', '-' and '_'"
    raise LaunchError(f"{where}: {host!r} is not a host name", why, "write the node's host name or address")


def _slot_count(value: str | None, default: int | None, where: str) -> int:
    if value is None:
        if default is None:
            raise LaunchError(
                f"{where}: no slot count",
                "a bare host name needs --nproc-per-node to say how many processes it runs",
                "write 'HOST slots=N', or pass --nproc-per-node",
            )
        value = str(default)
        where = f"{where} (slots from --nproc-per-node)"
    if not _COUNT.fullmatch(value) or not 1 <= int(value) <= MAX_SLOTS:
        raise LaunchError(
            f"{where}: slot count {value[:40]!r} is not an integer from 1 to {MAX_SLOTS}",
            "a node runs one process per slot",
            "write e.g. 'slots=4'",
        )
    return int(value)


def parse_host_list(spec: str) -> list[Node]:
    """horovodrun's ``-H h1:2,h2:2`` (a host without a count has 1 slot)."""
    nodes: list[Node] = []
    where = f"-H {spec!r}"
    for item in filter(None, (part.strip() for part in spec.split(","))):
        host, _, count = item.rpartition(":") if ":" in item else (item, "", "1")
        if not host:
            raise LaunchError(
                f"{where}: cannot read {item!r}",
                "the host list is HOST:SLOTS[,HOST:SLOTS...], as for horovodrun",
                "write e.g. -H node1:2,node2:2",
            )
        check_host(host, where)
        nodes.append(Node(host=host, slots=tuple(range(_slot_count(count, None, f"{where}, {item!r}")))))
    if not nodes:
        raise LaunchError(f"{where} lists no hosts")
    return nodes


def _parse_filter(spec: str, flag: str) -> dict[str, tuple[int, ...] | None]:
    """``host[:s,s]@host`` → {host: slots or None for all}."""
    out: dict[str, tuple[int, ...] | None] = {}
    for part in filter(None, spec.split("@")):
        host, _, slots = part.partition(":")
        if not host or (slots and not all(_COUNT.fullmatch(s.strip()) for s in slots.split(","))):
            raise LaunchError(
                f"{flag} {spec!r}: cannot read {part!r}",
                f"{flag} takes HOST[:SLOT,SLOT...] entries joined by '@', as DeepSpeed's launcher does",
                f"write e.g. {flag} 'node1:0,1@node2'",
            )
        out[host] = tuple(int(s) for s in slots.split(",")) if slots else None
    return out


def select_nodes(
    nodes: list[Node],
    *,
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int | None = None,
    num_gpus: int | None = None,
) -> list[Node]:
    """Apply DeepSpeed's --include / --exclude / --num_nodes / --num_gpus to a node list."""
    if include and exclude:
        raise LaunchError("--include and --exclude were both given", fix="use one of them")
    known = {n.host: n for n in nodes}
    if include:
        wanted = _parse_filter(include, "--include")
        _check_known(wanted, known, "--include")
        nodes = [_keep(known[h], s, "--include") for h, s in wanted.items()]
    if exclude:
        dropped = _parse_filter(exclude, "--exclude")
        _check_known(dropped, known, "--exclude")
        kept = []
        for node in nodes:
            if node.host not in dropped:
                kept.append(node)
            elif dropped[node.host] is not None:
                remaining = tuple(s for s in node.slots if s not in (dropped[node.host] or ()))
                if remaining:
                    kept.append(Node(host=node.host, slots=remaining))
        nodes = kept
    if num_nodes is not None:
        if num_nodes < 1 or num_nodes > len(nodes):
            raise LaunchError(
                f"--num_nodes {num_nodes} but {len(nodes)} node(s) are available",
                fix=f"ask for 1 to {len(nodes)} nodes, or add hosts to the hostfile",
            )
        nodes = nodes[:num_nodes]
    if num_gpus is not None:
        short = [n.host for n in nodes if n.nproc < num_gpus]
        if num_gpus < 1 or short:
            raise LaunchError(
                f"--num_gpus {num_gpus} is more than the slots of {', '.join(short) or 'the nodes'}",
                fix="lower --num_gpus or raise the hosts' slots in the hostfile",
            )
        nodes = [Node(host=n.host, slots=n.slots[:num_gpus]) for n in nodes]
    if not nodes:
        raise LaunchError("no node is left after --include / --exclude", fix="check the filters")
    return nodes


def _check_known(wanted: dict[str, tuple[int, ...] | None], known: dict[str, Node], flag: str) -> None:
    for host in wanted:
        if host not in known:
            raise LaunchError(
                f"{flag} names host {host}, which is not in the host list",
                f"hosts available: {', '.join(known)}",
                "add it to the hostfile, or correct the name",
            )


def _keep(node: Node, slots: tuple[int, ...] | None, flag: str) -> Node:
    if slots is None:
        return node
    missing = [s for s in slots if s not in node.slots]
    if missing:
        raise LaunchError(
            f"{flag} asks for slot(s) {missing} of {node.host}, which has slots {list(node.slots)}",
            fix="use slot indices below the host's slot count",
        )
    return Node(host=node.host, slots=slots)


def distribute(nodes: list[Node], total: int) -> list[Node]:
    """horovodrun's ``-np``: fill hosts in order, up to their slots."""
    capacity = sum(n.nproc for n in nodes)
    if total < 1 or total > capacity:
        raise LaunchError(
            f"-np {total} but the hosts offer {capacity} slot(s)",
            fix="lower -np or list more slots (-H host:SLOTS)",
        )
    out: list[Node] = []
    left = total
    for node in nodes:
        if left == 0:
            break
        take = min(left, node.nproc)
        out.append(Node(host=node.host, slots=node.slots[:take]))
        left -= take
    return out


def is_this_machine(host: str) -> bool:
    """Whether ``host`` names this machine: only its own addresses can be bound."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe, contextlib.suppress(OSError):
        probe.bind((address, 0))
        return True
    return False
