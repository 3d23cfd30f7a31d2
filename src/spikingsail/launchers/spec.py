"""What ``sail launch`` asks for, typed: the request every launcher turns into commands."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from spikingsail.errors import LaunchError
from spikingsail.launchers.hostfile import Node

MAX_SECONDS = 86_400
"""The longest timeout a flag takes: a day; more is a typo (and ssh's and torchft's timeouts are ints)."""
MAX_PORT = 65535


def in_range(
    flag: str, value: float, low: float, high: float, *, why: str, fix: str, above: bool = False
) -> float:
    """``value`` when it is finite and from ``low`` (``above``: greater than ``low``) to ``high``;
    otherwise the error a user reads before anything starts, not the traceback a node prints later."""
    finite = isinstance(value, int) or math.isfinite(value)  # an int of 400 digits has no float
    if finite and (value > low if above else value >= low) and value <= high:
        return value
    bounds = f"above {low:g}" if above else f"from {low:g}"
    raise LaunchError(f"{flag} {str(value)[:40]}", f"{why}: a number {bounds} to {high:g}", fix)


def check_counts(counts: dict[str, tuple[int | None, int, int]]) -> None:
    """Every given count (flag → value, low, high) a whole number from low to high."""
    for flag, (value, low, high) in counts.items():
        if value is not None:
            in_range(
                flag, value, low, high, why="it is a count", fix=f"give a whole number from {low} to {high}"
            )


def check_port(flag: str, value: int, fix: str) -> int:
    return int(in_range(flag, value, 1, MAX_PORT, why="it is a TCP port", fix=fix))


def check_seconds(flag: str, value: float, low: float, fix: str) -> float:
    """A timeout in seconds above ``low``, finite, at most a day."""
    return in_range(flag, value, low, MAX_SECONDS, why="it is a time in seconds", fix=fix, above=True)


@dataclass(kw_only=True, slots=True, frozen=True)
class SSHOptions:
    port: int | None = None
    user: str | None = None
    config: str | None = None
    connect_timeout: int = 10
    heartbeat_timeout: int = 30
    """Seconds without a heartbeat after which a node ends its part of the job, and ``sail launch``
    gives the node up (ssh's ServerAlive checks)."""

    def args(self) -> list[str]:
        """ssh client options: never a password prompt, never an unbounded connect."""
        out = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.connect_timeout}"]
        if self.config:
            out += ["-F", self.config]
        if self.port:
            out += ["-p", str(self.port)]
        if self.user:
            out += ["-l", self.user]
        return out

    def command(self, host: str, remote: str, *, tty: bool = False, keepalive: bool = False) -> list[str]:
        """``ssh [-tt] OPTIONS -- HOST REMOTE``: after ``--`` ssh reads no option, so no host name
        can become one (``-oProxyCommand=...`` would run a command here). ``keepalive``: the client
        gives the host up after ``heartbeat_timeout`` seconds without an answer."""
        alive = []
        if keepalive:
            interval = max(1, self.heartbeat_timeout // 3)
            alive = ["-o", f"ServerAliveInterval={interval}", "-o", "ServerAliveCountMax=3"]
        return ["ssh", *(["-tt"] if tty else []), *alive, *self.args(), "--", host, remote]


@dataclass(kw_only=True, slots=True, frozen=True)
class LaunchRequest:
    script: str
    script_args: list[str]
    torchrun_args: list[str]
    """torchrun flags passed through unchanged (for multi-node: those not set per node)."""
    nproc_per_node: str
    launcher: str
    nodes: list[Node] | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    master_port: int = 29500
    ssh: SSHOptions = field(default_factory=SSHOptions)
    env: dict[str, str] = field(default_factory=dict)
    launcher_args: list[str] = field(default_factory=list)
    """Extra arguments for the transport itself (e.g. mpirun's --mca settings, srun's options)."""
    dist_init_method: str = "torchrun"
    """slurm: srun starts one task per process instead of one torchrun agent per node."""
    explicit_nproc: bool = False
    explicit_master_port: bool = False
    runs_module: bool = False
    """``-m``: the script is a module name, as for ``python -m`` (torchrun's flag)."""
    no_python: bool = False
    """``--no-python``: the script is a program, started without Python (torchrun's flag)."""
    dry_run: bool = False
    ft_replicas: int = 0
    """``--ft-replicas``: replica groups recovering from each other through torchft (0: off)."""
    ft_heartbeat_timeout: float = 1.0
    world_size: int | None = None
    """How many processes the job's engine counts (every replica group's together), where the
    command line settles it; None where it does not (an elastic ``--nnodes``, ``--nproc-per-node
    gpu``, a SLURM allocation's own size)."""
    max_restarts: int = 0
    """torchrun's ``--max-restarts``; with ``--ft-replicas`` also how often a group whose agent ended
    is started again while other groups train."""


def require_first_slots(request: LaunchRequest, launcher: str) -> None:
    """Launchers that start one command per host (mpirun, horovodrun) cannot honour slot lists."""
    assert request.nodes, "parse_request gives multi-node launchers their nodes"
    custom = [n.host for n in request.nodes if n.slots != tuple(range(n.nproc))]
    if custom:
        raise LaunchError(
            f"--launcher {launcher} cannot give {', '.join(custom)} a chosen set of slots",
            f"{launcher} starts the same command on every host, so every host uses its first N GPUs",
            "use --num_gpus instead of slot lists, or --launcher ssh",
        )
