"""`sail launch`'s command line → one typed ``LaunchRequest``.

torchrun's own parser reads torchrun's flags, so they mean exactly what they mean to torchrun;
SpikingSail adds ``-n``, ``--dry-run`` and the multi-node flags of DeepSpeed's and horovodrun's
launchers (``-H``, ``--include``, ``--exclude``, ``--num_nodes``, ``--num_gpus``, ``-np``).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.run import get_args_parser

from spikingsail.environments.slurm import in_allocation
from spikingsail.errors import LaunchError
from spikingsail.launchers.command import FORWARDED_SIGNALS
from spikingsail.launchers.hostfile import (
    MAX_SLOTS,
    Node,
    distribute,
    parse_host_list,
    parse_hostfile,
    select_nodes,
)
from spikingsail.launchers.platform import platform_flags
from spikingsail.launchers.remote_env import explicit_env

# SpikingSail's flags and how many values each takes; they never reach torchrun.
_OWN_FLAGS = {
    "-n": 1, "--dry-run": 0, "-H": 1, "--hostfile": 1, "-np": 1, "--include": 1, "--exclude": 1,
    "--num_nodes": 1, "--num-nodes": 1, "--num_gpus": 1, "--num-gpus": 1, "--launcher": 1,
    "--ssh-port": 1, "--ssh-user": 1, "--ssh-config": 1, "--connect-timeout": 1, "--heartbeat-timeout": 1,
    "--env": 1,
    "--launcher-args": 1, "--launcher_args": 1, "--dist-init-method": 1, "--dist_init_method": 1,
}  # fmt: skip
# torchrun flags a multi-node launcher sets itself for every node.
_PER_NODE_FLAGS = {
    "--nnodes": 1, "--nproc-per-node": 1, "--nproc_per_node": 1, "--rdzv-backend": 1, "--rdzv_backend": 1,
    "--rdzv-endpoint": 1, "--rdzv_endpoint": 1, "--rdzv-id": 1, "--rdzv_id": 1, "--standalone": 0,
    "--node-rank": 1, "--node_rank": 1, "--master-addr": 1, "--master_addr": 1, "--master-port": 1,
    "--master_port": 1,
}  # fmt: skip
# Flags with which the user chooses the rendezvous; any of them turns platform mode off.
_RENDEZVOUS_FLAGS = tuple(f for f in _PER_NODE_FLAGS if "nproc" not in f)
LAUNCHERS = ("local", "ssh", "pdsh", "mpirun", "slurm", "horovodrun")
MODULE_FLAGS = ("-m", "--module")


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
    dry_run: bool = False

    @property
    def runs_module(self) -> bool:
        """``-m``: the script is a module name, as for ``python -m`` (torchrun's flag)."""
        return any(arg.split("=", 1)[0] in MODULE_FLAGS for arg in self.torchrun_args)


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


def parser() -> argparse.ArgumentParser:
    p = get_args_parser()
    p.prog = "sail launch"
    p.description = "Start a training script under torchrun's elastic agent, here or on many nodes."
    own = p.add_argument_group("SpikingSail")
    own.add_argument("-n", dest="nproc_per_node", default=argparse.SUPPRESS, help="same as --nproc-per-node")
    own.add_argument(
        "--dry-run", action="store_true", help="print the commands per node instead of running them"
    )
    own.add_argument("-H", "--hostfile", help="hostfile ('HOST slots=N' lines) or a host list 'h1:2,h2:2'")
    own.add_argument(
        "-np", dest="total_procs", type=int, help="total processes, filling hosts in order (horovodrun)"
    )
    own.add_argument("--include", help="DeepSpeed's host[:slot,...]@host filter")
    own.add_argument("--exclude", help="DeepSpeed's host[:slot,...]@host filter")
    own.add_argument("--num_nodes", "--num-nodes", dest="num_nodes", type=int, help="use the first N hosts")
    own.add_argument("--num_gpus", "--num-gpus", dest="num_gpus", type=int, help="use N slots per host")
    own.add_argument(
        "--launcher", choices=LAUNCHERS, help="how to start the per-node agents or processes (default: ssh)"
    )
    own.add_argument("--ssh-port", type=int, help="ssh port of the hosts (e.g. 222)")
    own.add_argument("--ssh-user", help="remote user name")
    own.add_argument("--ssh-config", help="ssh client config file (ssh -F)")
    own.add_argument("--connect-timeout", type=int, default=10, help="seconds to reach a host before failing")
    own.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=30,
        help="seconds without a heartbeat from sail launch after which a node ends its part of the job "
        "(ssh, pdsh); also how long sail waits for a silent node (default 30)",
    )
    own.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY[=VALUE]",
        help="set on every node; KEY alone ships this shell's value (keeps a token off command lines)",
    )
    own.add_argument(
        "--launcher-args",
        "--launcher_args",
        dest="launcher_args",
        default="",
        help="extra arguments for the launcher command (mpirun, srun), as one string",
    )
    own.add_argument(
        "--dist-init-method",
        "--dist_init_method",
        dest="dist_init_method",
        default="torchrun",
        choices=("torchrun", "slurm"),
        help="under SLURM: one torchrun agent per node (torchrun) or one srun task per process (slurm)",
    )
    return p


def parse_request(argv: list[str]) -> LaunchRequest:
    ns = parser().parse_args(argv)
    split = _script_index(argv, ns.training_script, ns.training_script_args)
    head = _strip(argv[:split], _OWN_FLAGS)
    explicit_nproc = any(
        _flag_name(a) in ("-n", "--nproc-per-node", "--nproc_per_node") for a in argv[:split]
    )
    _check_script(ns)
    nodes = _nodes(ns)
    launcher = ns.launcher or ("ssh" if nodes else "slurm" if in_allocation(os.environ) else "local")
    if launcher not in ("local", "slurm") and not nodes:
        raise LaunchError(
            f"--launcher {launcher} needs hosts", fix="pass -H hostfile (or -H host1:2,host2:2)"
        )
    if launcher == "slurm" and not in_allocation(os.environ):
        raise LaunchError(
            "--launcher slurm outside a SLURM allocation",
            "srun needs an allocation (SLURM_JOB_ID) to start the job in",
            "run inside salloc or an sbatch script, or use `sail submit` to write and submit one",
        )
    if ns.dist_init_method == "slurm" and launcher != "slurm":
        raise LaunchError(
            "--dist-init-method slurm needs a SLURM allocation", fix="run it inside salloc or sbatch"
        )
    if launcher == "local":
        if _flag_name_in(argv[:split], ("-n",)):
            head = ["--nproc-per-node", str(ns.nproc_per_node), *head]
        platform = None if _flag_name_in(head, _RENDEZVOUS_FLAGS) else platform_flags(os.environ)
        if platform:
            head = [*platform, *head]
        elif _single_node(ns, head):
            # torchrun's default static rendezvous binds port 29500: two jobs on one machine
            # would collide. --standalone picks a free port for a single-node job.
            head = ["--standalone", *head]
    else:
        head = _strip(head, _PER_NODE_FLAGS)
    if launcher not in ("mpirun", "horovodrun") and not _flag_name_in(
        head, ("--signals-to-handle", "--signals_to_handle")
    ):
        # torchrun's agent passes on the signals it handles; SIGUSR1 (sbatch --signal=USR1@T) is not
        # among its defaults, and the agent would die of it without telling the workers to save.
        head = [*head, "--signals-to-handle", FORWARDED_SIGNALS]
    return LaunchRequest(
        script=ns.training_script,
        script_args=list(ns.training_script_args),
        torchrun_args=head,
        nproc_per_node=str(ns.nproc_per_node),
        launcher=launcher,
        nodes=_apply_nproc(nodes, ns, explicit_nproc) if nodes else None,
        rdzv_endpoint=ns.rdzv_endpoint or None,
        rdzv_id=None if ns.rdzv_id == "none" else ns.rdzv_id,
        master_port=int(ns.master_port or 29500),
        ssh=SSHOptions(
            port=ns.ssh_port,
            user=ns.ssh_user,
            config=ns.ssh_config,
            connect_timeout=ns.connect_timeout,
            heartbeat_timeout=_heartbeat_timeout(ns.heartbeat_timeout),
        ),
        env=explicit_env(ns.env),
        launcher_args=shlex.split(ns.launcher_args),
        dist_init_method=ns.dist_init_method,
        explicit_nproc=explicit_nproc,
        explicit_master_port=_flag_name_in(argv[:split], ("--master-port", "--master_port")),
        dry_run=ns.dry_run,
    )


def _heartbeat_timeout(seconds: int) -> int:
    if seconds < 3:
        raise LaunchError(
            f"--heartbeat-timeout {seconds}",
            "a heartbeat goes every second; under 3 s a busy moment on a node would end the job",
            "give 3 seconds or more (the default is 30)",
        )
    return seconds


def _check_script(ns: argparse.Namespace) -> None:
    script = Path(ns.training_script)
    if not (ns.module or ns.no_python or script.is_file()):
        raise LaunchError(
            f"training script {script} does not exist",
            f"it is resolved from the current directory, {Path.cwd()}",
            "check the path, or pass -m to run a module",
        )
    count = _count(ns.nproc_per_node)
    if count is None and ns.nproc_per_node not in ("cpu", "gpu", "auto"):
        raise LaunchError(
            f"--nproc-per-node {str(ns.nproc_per_node)[:40]!r} is not a number",
            fix="give a process count, or one of auto, cpu, gpu",
        )
    if count is not None and not 1 <= count <= MAX_SLOTS:
        raise LaunchError(
            f"--nproc-per-node {count} is not a process count from 1 to {MAX_SLOTS}",
            fix="give the number of processes (GPUs) per node",
        )


def _count(value: object) -> int | None:
    """A process count given as ASCII digits (``str.isdigit`` accepts '²', which ``int`` refuses)."""
    text = str(value)
    return int(text) if re.fullmatch(r"[0-9]{1,9}", text) else None


def _nodes(ns: argparse.Namespace) -> list[Node] | None:
    if not ns.hostfile and ns.launcher == "horovodrun":
        # as horovodrun without -H: every process on this machine (-np, or --nproc-per-node)
        count = ns.total_procs if ns.total_procs is not None else _count(ns.nproc_per_node)
        if count is not None:
            if not 1 <= count <= MAX_SLOTS:
                raise LaunchError(f"-np {count} is not a process count from 1 to {MAX_SLOTS}")
            return [Node(host="localhost", slots=tuple(range(count)))]
    if not ns.hostfile:
        for flag in ("include", "exclude", "num_nodes", "num_gpus", "total_procs"):
            if getattr(ns, flag) is not None:
                raise LaunchError(f"--{flag.replace('_', '-')} needs hosts", fix="pass -H hostfile")
        return None
    default = _count(ns.nproc_per_node)
    if Path(ns.hostfile).is_file():
        nodes = parse_hostfile(ns.hostfile, default_slots=default)
    elif ":" in ns.hostfile or "," in ns.hostfile:
        nodes = parse_host_list(ns.hostfile)
    else:
        raise LaunchError(
            f"-H {ns.hostfile}: no such hostfile",
            "-H takes a hostfile path or a host list such as node1:2,node2:2",
            "check the path",
        )
    nodes = select_nodes(
        nodes, include=ns.include, exclude=ns.exclude, num_nodes=ns.num_nodes, num_gpus=ns.num_gpus
    )
    return distribute(nodes, ns.total_procs) if ns.total_procs is not None else nodes


def _apply_nproc(nodes: list[Node], ns: argparse.Namespace, explicit: bool) -> list[Node]:
    """An explicit --nproc-per-node caps the slots every host uses."""
    n = _count(ns.nproc_per_node)
    return select_nodes(nodes, num_gpus=n) if explicit and n is not None else nodes


def _script_index(argv: list[str], script: str, script_args: list[str]) -> int:
    for i in range(len(argv) - len(script_args) - 1, -1, -1):
        if argv[i] == script and argv[i + 1 :] == script_args:
            return i
    raise LaunchError(f"cannot find the training script {script!r} in the command line")


def with_default_nproc(flags: list[str], nproc: int) -> list[str]:
    """``flags`` led by ``-n NPROC`` unless they choose a process count or hosts themselves: for
    jobs that need a process group to mean anything (`sail doctor`, `sail bench comm`)."""
    chosen = _flag_name_in(flags, ("-n", "--nproc-per-node", "--nproc_per_node", "-H", "--hostfile"))
    return flags if chosen or any(a.startswith("-H") for a in flags) else ["-n", str(nproc), *flags]


def _flag_name(arg: str) -> str:
    if arg.startswith("-n") and _count(arg[2:]) is not None:
        return "-n"
    return arg.split("=", 1)[0]


def _flag_name_in(args: list[str], names: tuple[str, ...]) -> bool:
    return any(_flag_name(a) in names for a in args)


def _strip(head: list[str], flags: dict[str, int]) -> list[str]:
    out: list[str] = []
    skip = 0
    for arg in head:
        if skip:
            skip -= 1
            continue
        name = _flag_name(arg)
        if name in flags:
            attached = "=" in arg or (name == "-n" and arg != "-n")
            skip = 0 if attached else flags[name]
        else:
            out.append(arg)
    return out


def _single_node(ns: argparse.Namespace, head: list[str]) -> bool:
    return (
        str(ns.nnodes) in ("1", "1:1")
        and not ns.rdzv_endpoint
        and not ns.standalone
        and not _flag_name_in(head, ("--master-port", "--master_port"))
    )
