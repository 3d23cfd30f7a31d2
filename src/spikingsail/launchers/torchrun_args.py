"""torchrun's flags on ``sail launch``'s command line, read once into ``TorchrunArgs``.

torchrun's own parser gives the values; which flags the user wrote, rather than left to their
defaults, is read from the command line once, beside them: a launcher decides from it whether to
add a process count, a rendezvous or the signals to handle, without looking at argv again.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from spikingsail.errors import LaunchError, first_line
from spikingsail.launchers.spec import check_port

# torchrun flags a multi-node launcher sets itself for every node, and how many values each takes.
PER_NODE_FLAGS = {
    "--nnodes": 1, "--nproc-per-node": 1, "--rdzv-backend": 1, "--rdzv-endpoint": 1, "--rdzv-id": 1,
    "--standalone": 0, "--node-rank": 1, "--master-addr": 1, "--master-port": 1,
}  # fmt: skip
# Flags with which the user chooses the rendezvous; any of them turns platform mode off.
RENDEZVOUS_FLAGS = frozenset(f for f in PER_NODE_FLAGS if f != "--nproc-per-node")
_NPROC_FLAGS = frozenset({"-n", "--nproc-per-node"})
TORCHRUN_MASTER_PORT = 29500
"""torchrun's ``--master-port`` when none is given (``torch.distributed.run.run``)."""


def flag_name(arg: str) -> str:
    """The flag an argument names, one spelling for each (``--nproc_per_node=2`` and
    ``--nproc-per-node`` are ``--nproc-per-node``; ``-n4`` is ``-n``, ``-Hhostfile`` is ``-H``)."""
    if arg.startswith("-n") and count(arg[2:]) is not None:
        return "-n"
    if arg[:2] in ("-H", "-i", "-e") and not arg.startswith("-hostfile"):
        return arg[:2]  # sail's one-letter flags, their value attached or not
    name = arg.split("=", 1)[0]
    return name.replace("_", "-") if name.startswith("--") else name


def flag_names(args: list[str]) -> frozenset[str]:
    return frozenset(flag_name(arg) for arg in args)


def names_hosts(args: list[str]) -> bool:
    """Whether ``args`` give hosts: ``-H FILE``, ``-HFILE``, ``--hostfile FILE``, ``--hostfile=FILE``."""
    return any(arg.startswith(("-H", "--hostfile", "--hosts", "-hostfile")) for arg in args)


def count(value: object) -> int | None:
    """A process count given as ASCII digits (``str.isdigit`` accepts '²', which ``int`` refuses)."""
    text = str(value)
    return int(text) if re.fullmatch(r"[0-9]{1,9}", text) else None


def strip_flags(args: list[str], flags: dict[str, int]) -> list[str]:
    """``args`` without the named flags and their values (``flags``: name → number of values)."""
    out: list[str] = []
    skip = 0
    for arg in args:
        if skip:
            skip -= 1
            continue
        name = flag_name(arg)
        if name in flags:
            attached = "=" in arg or (arg != name and not arg.startswith("--"))
            skip = 0 if attached else flags[name]
        else:
            out.append(arg)
    return out


@dataclass(kw_only=True, slots=True, frozen=True)
class TorchrunArgs:
    """torchrun's part of a ``sail launch`` command line."""

    flags: list[str]
    """torchrun's flags as written, SpikingSail's own removed."""
    written: frozenset[str]
    """Every flag on the command line before the script, as ``flag_name`` spells it."""
    nproc_per_node: str
    nnodes: str
    rdzv_endpoint: str | None
    rdzv_id: str | None
    master_port: int
    """``--master-port``, else torchrun's default 29500."""
    standalone: bool

    @classmethod
    def read(cls, ns: argparse.Namespace, before_script: list[str], own: dict[str, int]) -> TorchrunArgs:
        """From torchrun's parser's values ``ns`` and the command line before the script; ``own``:
        SpikingSail's flags and how many values each takes (they never reach torchrun)."""
        return cls(
            flags=strip_flags(before_script, own),
            written=flag_names(before_script),
            nproc_per_node=str(ns.nproc_per_node),
            nnodes=str(ns.nnodes),
            rdzv_endpoint=ns.rdzv_endpoint or None,
            rdzv_id=None if ns.rdzv_id == "none" else ns.rdzv_id,
            master_port=TORCHRUN_MASTER_PORT if ns.master_port is None else int(ns.master_port),
            standalone=bool(ns.standalone),
        )

    @property
    def explicit_nproc(self) -> bool:
        return bool(self.written & _NPROC_FLAGS)

    @property
    def short_nproc(self) -> bool:
        """``-n``, SpikingSail's spelling, which torchrun does not know."""
        return "-n" in self.written

    @property
    def explicit_master_port(self) -> bool:
        return "--master-port" in self.written

    @property
    def chooses_rendezvous(self) -> bool:
        return bool(self.written & RENDEZVOUS_FLAGS)

    @property
    def explicit_max_restarts(self) -> bool:
        """``--max-restarts`` on the command line (any spelling argparse takes, an abbreviation too)."""
        return any(len(flag) > 2 and "--max-restarts".startswith(flag) for flag in self.written)

    @property
    def chooses_signals(self) -> bool:
        return "--signals-to-handle" in self.written

    @property
    def module(self) -> bool:
        """``-m``: the script is a module name, as for ``python -m``."""
        return bool(self.written & {"-m", "--module"})

    @property
    def no_python(self) -> bool:
        return "--no-python" in self.written

    @property
    def single_node(self) -> bool:
        """One node and no rendezvous of the user's: torchrun's default would be a static one on 29500."""
        return (
            self.nnodes in ("1", "1:1")
            and not self.rdzv_endpoint
            and not self.standalone
            and not self.explicit_master_port
        )

    def without_per_node(self) -> list[str]:
        """The flags every node's agent gets when the launcher sets the per-node ones itself."""
        return strip_flags(self.flags, PER_NODE_FLAGS)


def check_values(ns: argparse.Namespace) -> tuple[int, int, int | None]:
    """torchrun's own checks of its values, made here before anything starts: torchrun makes them
    in its agent on every node, which ends with a traceback after the job was started. Uses
    torchrun's own parsing (``parse_min_max_nnodes``, ``get_rdzv_endpoint``,
    ``parse_rendezvous_endpoint``), so what passes here is what torchrun accepts (and a master
    port that is not 0). Returns the (min, max) node counts and the port of ``--rdzv-endpoint``."""
    # torch only here: `sail doctor` reads the flags' names without it, to report a broken torch
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT as C10D_PORT
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    low, high = node_range(str(ns.nnodes))
    if ns.max_restarts < 0:
        raise LaunchError(
            f"--max-restarts {ns.max_restarts}",
            "it is how often torchrun starts the workers again after a failure",
            "give 0 (no restart) or more",
        )
    if ns.master_port is not None:  # 0 too: any free port, which the other processes cannot know
        check_port("--master-port", ns.master_port, "give a free port, e.g. 29500 (torchrun's default)")
    endpoint, static = _endpoint(ns, high)
    flag = "--rdzv-endpoint" if ns.rdzv_endpoint else "--master-addr"
    try:
        _, port = parse_rendezvous_endpoint(endpoint, -1 if static else C10D_PORT)
    except ValueError as err:
        raise LaunchError(
            f"{flag} {(ns.rdzv_endpoint or ns.master_addr)[:80]!r}",
            f"torchrun refuses it: {first_line(err)}",
            "write a host name or address"
            + (", and a port up to 65535 after ':'" if ns.rdzv_endpoint else ""),
        ) from None
    if port == -1:  # torchrun's static rendezvous has no default port
        raise LaunchError(
            f"--rdzv-endpoint {endpoint} names no port",
            "the static rendezvous (torchrun's default backend) has no default port",
            "write HOST:PORT, or pass --rdzv-backend c10d",
        )
    return low, high, port if ns.rdzv_endpoint else None


def _endpoint(ns: argparse.Namespace, most_nodes: int) -> tuple[str, bool]:
    """The rendezvous endpoint torchrun settles on, and whether its rendezvous is static: as
    ``torch.distributed.run.run`` does, --standalone and a one-node static rendezvous named by
    neither an endpoint nor a master port become c10d on ``localhost:0``."""
    from torch.distributed.run import get_rdzv_endpoint

    static = ns.rdzv_backend == "static"
    alone = static and not ns.rdzv_endpoint and ns.master_port is None and most_nodes == 1
    if ns.standalone or alone:
        return "localhost:0", False
    port = TORCHRUN_MASTER_PORT if ns.master_port is None else ns.master_port
    return get_rdzv_endpoint(argparse.Namespace(**{**vars(ns), "master_port": port})), static  # type: ignore[no-untyped-call]


def node_range(text: str) -> tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX`` as torchrun reads it, with torchrun's rule 0 < MIN <= MAX."""
    from torch.distributed.run import parse_min_max_nnodes

    try:
        low, high = parse_min_max_nnodes(text)
    except (ValueError, RuntimeError):
        low, high = 0, -1
    if not 0 < low <= high:
        raise LaunchError(
            f"--nnodes {text[:40]!r}",
            "it is a number of nodes N, or MIN:MAX for an elastic job, with 1 <= MIN <= MAX",
            "write e.g. --nnodes 2 or --nnodes 1:4",
        )
    return low, high
