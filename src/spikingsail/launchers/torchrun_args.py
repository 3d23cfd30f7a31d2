"""torchrun's flags on ``sail launch``'s command line, read once into ``TorchrunArgs``.

torchrun's own parser gives the values; which flags the user wrote, rather than left to their
defaults, is read from the command line once, beside them: a launcher decides from it whether to
add a process count, a rendezvous or the signals to handle, without looking at argv again.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

# torchrun flags a multi-node launcher sets itself for every node, and how many values each takes.
PER_NODE_FLAGS = {
    "--nnodes": 1, "--nproc-per-node": 1, "--rdzv-backend": 1, "--rdzv-endpoint": 1, "--rdzv-id": 1,
    "--standalone": 0, "--node-rank": 1, "--master-addr": 1, "--master-port": 1,
}  # fmt: skip
# Flags with which the user chooses the rendezvous; any of them turns platform mode off.
RENDEZVOUS_FLAGS = frozenset(f for f in PER_NODE_FLAGS if f != "--nproc-per-node")
_NPROC_FLAGS = frozenset({"-n", "--nproc-per-node"})


def flag_name(arg: str) -> str:
    """The flag an argument names, one spelling for each (``--nproc_per_node=2`` and
    ``--nproc-per-node`` are ``--nproc-per-node``; ``-n4`` is ``-n``, ``-Hhostfile`` is ``-H``)."""
    if arg.startswith("-n") and count(arg[2:]) is not None:
        return "-n"
    if arg.startswith("-H"):
        return "-H"
    name = arg.split("=", 1)[0]
    return name.replace("_", "-") if name.startswith("--") else name


def flag_names(args: list[str]) -> frozenset[str]:
    return frozenset(flag_name(arg) for arg in args)


def names_hosts(args: list[str]) -> bool:
    """Whether ``args`` give hosts: ``-H FILE``, ``-HFILE``, ``--hostfile FILE``, ``--hostfile=FILE``."""
    return any(arg.startswith(("-H", "--hostfile")) for arg in args)


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
            master_port=int(ns.master_port or 29500),
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
