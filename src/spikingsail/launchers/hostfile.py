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
# What may follow the host on a hostfile line: ``slots=N`` (DeepSpeed, Open MPI; Open MPI's
# ``max_slots=M`` after it, a limit on oversubscription that a job of ``slots`` processes never
# reaches) or seed 000's ``N``.
_SLOTS = re.compile(r"(?:slots\s*=\s*)?(?P<slots>[^\s=]+)(?:\s+max[_-]slots\s*=\s*(?P<most>\S+))?")
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
                "a hostfile line is 'HOST slots=N' (DeepSpeed; Open MPI's may add max_slots=M) or 'HOST N'; "
                "DeepSpeed's launcher would read the digits after slots= and ignore the rest",
                "fix or comment out that line",
            )
        if host in seen:
            raise LaunchError(
                f"{where}: host {host} is listed again (first on line {seen[host]})",
                "each host gets one line with all its slots",
                "merge the two lines",
            )
        seen[host] = number
        slots = _slot_count(match["slots"] if match else None, default_slots, where, _DEEPSPEED_READS)
        if (
            match
            and match["most"] is not None
            and _slot_count(match["most"], None, f"{where}: max_slots", _DEEPSPEED_READS) < slots
        ):
            raise LaunchError(
                f"{where}: max_slots {match['most']} is below slots {match['slots']}",
                "Open MPI refuses a host whose max_slots is below its slots (DeepSpeed's launcher would "
                "read slots and ignore max_slots)",
                "raise max_slots, or lower slots",
            )
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
        why = "a host name has only letters, digits, '.', '-' and '_' (a user goes in --ssh-user)"
    why += "; DeepSpeed's launcher and horovodrun would hand it to ssh as it is"
    raise LaunchError(f"{where}: {host!r} is not a host name", why, "write the node's host name or address")


_DEEPSPEED_READS = (
    "DeepSpeed's launcher would read the leading digits, and list a host of slots=0 with nothing to run"
)
_HOROVODRUN_READS = (
    "horovodrun would read it with Python's int, and list a host of 0 slots with nothing to run"
)


def _slot_count(value: str | None, default: int | None, where: str, peer: str = _DEEPSPEED_READS) -> int:
    """A slot count; ``peer``: what the peer whose file or flag it is would have made of a bad one."""
    if value is None:
        if default is None:
            raise LaunchError(
                f"{where}: no slot count",
                "a bare host name needs --nproc-per-node to say how many processes it runs "
                "(DeepSpeed's launcher refuses a line without slots=N)",
                "write 'HOST slots=N', or pass --nproc-per-node",
            )
        value = str(default)
        where = f"{where} (slots from --nproc-per-node)"
    if not _COUNT.fullmatch(value) or not 1 <= int(value) <= MAX_SLOTS:
        raise LaunchError(
            f"{where}: slot count {value[:40]!r} is not an integer from 1 to {MAX_SLOTS}",
            f"a node runs one process per slot ({peer})",
            "write e.g. 'slots=4', or leave the host out",
        )
    return int(value)


def parse_host_list(spec: str) -> list[Node]:
    """horovodrun's ``-H h1:2,h2:2`` (a host without a count has 1 slot, as for mpirun)."""
    nodes: list[Node] = []
    where = f"-H {spec!r}"
    for item in (part.strip() for part in spec.split(",")):
        host, _, count = item.partition(":") if ":" in item else (item, "", "1")
        if not host or ":" in count:
            raise LaunchError(
                f"{where}: cannot read {item!r}",
                "the host list is HOST:SLOTS[,HOST:SLOTS...], as for horovodrun",
                "write e.g. -H node1:2,node2:2",
            )
        check_host(host, where)
        if any(node.host == host for node in nodes):
            raise LaunchError(
                f"{where}: host {host} is named twice",
                "horovodrun would start both entries' processes with local ranks from 0: two on one GPU",
                "give the host once, with all its slots",
            )
        nodes.append(
            Node(
                host=host,
                slots=tuple(range(_slot_count(count.strip(), None, f"{where}, {item!r}", _HOROVODRUN_READS))),
            )
        )
    return nodes


def _parse_filter(spec: str, flag: str) -> dict[str, tuple[int, ...]]:
    """``host[:s,s]@host`` → {host: its slots, () for all}, as DeepSpeed's launcher reads it
    (``parse_node_config_list``): the entries of one host merge, their slots sorted without repeats
    (``a:1@a:2`` is ``a:1,2``; ``a@a:1`` is ``a:1``)."""
    out: dict[str, set[int]] = {}
    for part in spec.split("@"):
        host, colon, slots = part.partition(":")
        if not host or (colon and not all(_COUNT.fullmatch(s.strip()) for s in slots.split(","))):
            raise LaunchError(
                f"{flag} {spec!r}: cannot read {part!r}",
                f"{flag} takes HOST[:SLOT,SLOT...] entries joined by '@', as DeepSpeed's launcher does "
                "(which would read a slot such as +1 with Python's int)",
                f"write e.g. {flag} 'node1:0,1@node2'",
            )
        out.setdefault(host, set()).update(int(s) for s in slots.split(",") if colon)
    return {host: tuple(sorted(slots)) for host, slots in out.items()}


def select_nodes(
    nodes: list[Node],
    *,
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int | None = None,
    num_gpus: int | None = None,
) -> list[Node]:
    """Apply DeepSpeed's --include / --exclude / --num_nodes / --num_gpus to a node list, with the
    results and refusals of DeepSpeed's own ``parse_resource_filter``: the hosts stay in the host
    list's order, and a filter naming a host or slot the list lacks is refused."""
    if include and exclude:
        raise LaunchError(
            "--include and --exclude were both given",
            "DeepSpeed's launcher takes one of them",
            "use one of them",
        )
    for spec, flag in ((include, "--include"), (exclude, "--exclude")):
        if spec:
            chosen = _parse_filter(spec, flag)
            _check_known(chosen, nodes, flag)
            nodes = _filtered(nodes, chosen, keep=flag == "--include")
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
        raise LaunchError(
            "no node is left after --include / --exclude",
            "nothing would run (DeepSpeed's launcher would go on with no host and fail later)",
            "check the filters",
        )
    return nodes


def _check_known(chosen: dict[str, tuple[int, ...]], nodes: list[Node], flag: str) -> None:
    known = {n.host: n for n in nodes}
    for host, slots in chosen.items():
        if host not in known:
            raise LaunchError(
                f"{flag} names host {host}, which is not in the host list",
                f"hosts available: {', '.join(known)}",
                "add it to the hostfile, or correct the name",
            )
        missing = [s for s in slots if s not in known[host].slots]
        if missing:
            raise LaunchError(
                f"{flag} names slot(s) {missing} of {host}, which has slots {list(known[host].slots)}",
                "DeepSpeed's launcher refuses a slot the host does not have",
                "use slot indices below the host's slot count",
            )


def _filtered(nodes: list[Node], chosen: dict[str, tuple[int, ...]], *, keep: bool) -> list[Node]:
    """``--include`` (``keep``): the chosen hosts, with the chosen slots (all for ``()``);
    ``--exclude``: every host less the chosen slots (the whole host for ``()``). A host left with
    no slot is left out."""
    out = []
    for node in nodes:
        if node.host not in chosen:
            if not keep:
                out.append(node)
            continue
        named = chosen[node.host] or node.slots
        slots = named if keep else tuple(s for s in node.slots if s not in named)
        if slots:
            out.append(Node(host=node.host, slots=slots))
    return out


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
