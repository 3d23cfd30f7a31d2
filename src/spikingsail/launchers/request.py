"""`sail launch`'s command line → one typed ``LaunchRequest``.

torchrun's own parser reads torchrun's flags, so they mean exactly what they mean to torchrun;
SpikingSail adds ``-n``, ``--dry-run`` and the multi-node flags of DeepSpeed's and horovodrun's
launchers (``-H``, ``--include``, ``--exclude``, ``--num_nodes``, ``--num_gpus``, ``-np``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
from pathlib import Path

import torch
from torch.distributed.run import get_args_parser

from spikingsail.errors import LaunchError
from spikingsail.launchers import LAUNCHERS, deepspeed_flags, default_launcher
from spikingsail.launchers.command import FORWARDED_SIGNALS
from spikingsail.launchers.hostfile import (
    MAX_SLOTS,
    Node,
    distribute,
    parse_host_list,
    parse_hostfile,
    select_nodes,
)
from spikingsail.launchers.remote_env import explicit_env
from spikingsail.launchers.spec import (
    LaunchRequest,
    SSHOptions,
    check_port,
    check_seconds,
    in_range,
)
from spikingsail.launchers.torchrun_args import (
    TorchrunArgs,
    check_values,
    count,
    flag_name,
    flag_names,
    names_hosts,
    node_range,
)

__all__ = [
    "FORWARDED_SIGNALS",
    "LaunchRequest",
    "SSHOptions",
    "parse_request",
    "parser",
    "with_default_nproc",
]

# SpikingSail's flags and how many values each takes; they never reach torchrun.
_OWN_FLAGS = {
    "-n": 1, "--dry-run": 0, "-H": 1, "--hostfile": 1, "--hosts": 1, "-hostfile": 1, "-np": 1, "--num-proc": 1, "-i": 1, "--include": 1, "-e": 1, "--exclude": 1,
    "--num-nodes": 1, "--num-gpus": 1, "--num-accelerators": 1, "--launcher": 1, "--ssh-port": 1, "--ssh-user": 1, "--ssh-config": 1,
    "--connect-timeout": 1, "--heartbeat-timeout": 1, "--env": 1, "--launcher-args": 1, "--dist-init-method": 1,
    "--ft-replicas": 1, "--ft-heartbeat-timeout": 1,
} | {flag_name(s): int(f.metavar is not None) for f in deepspeed_flags.FLAGS for s in f.spellings}  # fmt: skip
LAUNCHER_NAMES = tuple(LAUNCHERS)
_DIST_INIT_METHODS = tuple(
    dict.fromkeys(m for launcher in LAUNCHERS.values() for m in launcher.dist_init_methods)
)


def parser() -> argparse.ArgumentParser:
    p = get_args_parser()
    p.prog = "sail launch"
    p.description = "Start a training script under torchrun's elastic agent, here or on many nodes."
    for action in p._actions:  # torchrun's parser leaves its script's arguments undescribed
        if action.dest == "training_script_args":
            action.help = "the training script's own arguments"
    own = p.add_argument_group("SpikingSail")
    own.add_argument("-n", dest="nproc_per_node", default=argparse.SUPPRESS, help="same as --nproc-per-node")
    own.add_argument(
        "--dry-run", action="store_true", help="print the commands per node instead of running them"
    )
    own.add_argument(
        "-H", "--hostfile", "--hosts", "-hostfile", dest="hostfile",
        help="hostfile ('HOST slots=N' lines) or a host list 'h1:2,h2:2' (horovodrun's -H and -hostfile alike)",
    )  # fmt: skip
    own.add_argument(
        "-np", "--num-proc", dest="total_procs", type=int,
        help="total processes, filling the hosts in order; without -H, on this machine (horovodrun)",
    )  # fmt: skip
    own.add_argument("-i", "--include", help="DeepSpeed's host[:slot,...]@host filter")
    own.add_argument("-e", "--exclude", help="DeepSpeed's host[:slot,...]@host filter")
    own.add_argument("--num_nodes", "--num-nodes", dest="num_nodes", type=int, help="use the first N hosts")
    own.add_argument(
        "--num_gpus",
        "--num-gpus",
        "--num_accelerators",
        dest="num_gpus",
        type=int,
        help="use N slots per host",
    )
    own.add_argument(
        "--launcher",
        choices=(*LAUNCHER_NAMES, *deepspeed_flags.LAUNCHER_NAMES, *deepspeed_flags.OTHER_MPIS),
        metavar="{" + ",".join(LAUNCHER_NAMES) + "}",
        help="how to start the per-node agents or processes (default: ssh; DeepSpeed's openmpi is mpirun)",
    )
    own.add_argument(
        "--ssh-port",
        "--ssh_port",
        dest="ssh_port",
        type=int,
        help="ssh port of the hosts (1 to 65535, e.g. 222)",
    )
    own.add_argument("--ssh-user", help="remote user name")
    own.add_argument("--ssh-config", help="ssh client config file (ssh -F)")
    own.add_argument(
        "--connect-timeout", type=int, default=10, help="seconds to reach a host before failing (1 to 86400)"
    )
    own.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=30,
        help="seconds without a heartbeat from sail launch after which a node ends its part of the job "
        "(ssh, pdsh); also how long sail waits for a silent node (3 to 86400, default 30)",
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
        choices=_DIST_INIT_METHODS,
        help="under SLURM: one torchrun agent per node (torchrun) or one srun task per process (slurm)",
    )
    own.add_argument(
        "--ft-replicas",
        dest="ft_replicas",
        type=int,
        default=0,
        metavar="R",
        help="run R replica groups of -n processes, each under its own torchrun agent, with torchft's "
        "lighthouse: a group that dies is restarted and heals from a live one while the others train on "
        f"(up to --max-restarts times, {FT_RESTARTS} unless given) "
        f"(with -H at most one group per host; here at most {MAX_SLOTS} processes in all)",
    )
    own.add_argument(
        "--ft-heartbeat-timeout",
        dest="ft_heartbeat_timeout",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="with --ft-replicas: a group silent this long leaves the quorum (above 0, at most 86400; default 1)",
    )
    deepspeed_flags.add_flags(p)
    return p


def parse_request(argv: list[str]) -> LaunchRequest:
    ns, argv = _parse(argv)
    deepspeed_flags.read_flags(ns)
    split = _script_index(argv, ns.training_script, ns.training_script_args)
    torchrun = _np_here(ns, TorchrunArgs.read(ns, argv[:split], _OWN_FLAGS))
    nnodes = check_values(ns)
    _check_script(ns)
    nodes = _nodes(ns, torchrun)
    name = ns.launcher or default_launcher(bool(nodes), os.environ)
    launcher = LAUNCHERS[name]()
    if launcher.needs_hosts and not nodes:
        raise LaunchError(f"--launcher {name} needs hosts", fix="pass -H hostfile (or -H host1:2,host2:2)")
    launcher.check(os.environ)
    if ns.dist_init_method not in launcher.dist_init_methods:
        raise LaunchError(
            "--dist-init-method slurm needs a SLURM allocation", fix="run it inside salloc or sbatch"
        )
    flags = launcher.torchrun_flags(torchrun, os.environ)
    if launcher.agent_signals and not torchrun.chooses_signals:
        # torchrun's agent passes on the signals it handles; SIGUSR1 (sbatch --signal=USR1@T) is not
        # among its defaults, and the agent would die of it without telling the workers to save.
        flags = [*flags, "--signals-to-handle", FORWARDED_SIGNALS]
    nodes = _apply_nproc(nodes, torchrun) if nodes else None
    _check_layout(name, nnodes, nodes, torchrun.nproc_per_node)
    groups = _ft_replicas(ns.ft_replicas, nodes, torchrun.nproc_per_node)
    return LaunchRequest(
        script=ns.training_script,
        script_args=list(ns.training_script_args),
        torchrun_args=flags,
        nproc_per_node=torchrun.nproc_per_node,
        launcher=name,
        nodes=nodes,
        rdzv_endpoint=torchrun.rdzv_endpoint,
        rdzv_id=torchrun.rdzv_id,
        master_port=torchrun.master_port,
        ssh=_ssh(ns),
        env=explicit_env(ns.env),
        launcher_args=_launcher_args(ns.launcher_args),
        dist_init_method=ns.dist_init_method,
        explicit_nproc=torchrun.explicit_nproc,
        explicit_master_port=torchrun.explicit_master_port,
        runs_module=torchrun.module,
        no_python=torchrun.no_python,
        dry_run=ns.dry_run,
        ft_replicas=groups,
        ft_heartbeat_timeout=check_seconds(
            "--ft-heartbeat-timeout", ns.ft_heartbeat_timeout, 0, "give a positive number, e.g. 1"
        ),
        world_size=_world_size(name, nodes, flags, ns.training_script, groups),
        max_restarts=FT_RESTARTS if groups and not torchrun.explicit_max_restarts else int(ns.max_restarts),
    )


FT_RESTARTS = 3
"""With ``--ft-replicas`` and no ``--max-restarts``: how often a failed group is started again (recovery
is what the flag asks for; ``--max-restarts 0`` keeps a dead group dead)."""

_LAUNCHER_ARGS = ("--launcher-args", "--launcher_args")


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command line read, and as read: ``--launcher_args '-mca btl ...'`` taken as DeepSpeed's
    launcher takes it, whatever its value starts with (argparse would read ``-mca`` as torchrun's
    ``-m``). Only before the script: the script's own arguments reach it as written."""
    glued = [i for i, arg in enumerate(argv[:-1]) if arg in _LAUNCHER_ARGS and argv[i + 1].startswith("-")]
    while True:
        joined = _glue(argv, glued)
        ns = parser().parse_args(joined)
        split = len(joined) - len(ns.training_script_args)
        kept = [i for n, i in enumerate(glued) if i - n < split]  # a glued pair moves the rest back one
        if kept == glued:
            return ns, joined
        glued = kept


def _glue(argv: list[str], at: list[int]) -> list[str]:
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif i in at:
            out.append(f"{arg}={argv[i + 1]}")
            skip = True
        else:
            out.append(arg)
    return out


def _np_here(ns: argparse.Namespace, torchrun: TorchrunArgs) -> TorchrunArgs:
    """horovodrun's ``-np N`` without hosts: N processes on this machine, as ``-n N``."""
    if ns.total_procs is None or ns.hostfile:
        return torchrun
    name = ns.launcher or default_launcher(False, os.environ)
    launcher = LAUNCHERS[name]
    if launcher.here_without_hosts:
        return torchrun  # the launcher's own command runs them here (_nodes)
    if not launcher.agents_here:
        raise LaunchError(
            f"-np {ns.total_procs} without -H under --launcher {name}",
            "-np fills the hosts of -H in order; without hosts it runs the processes on this machine, as "
            "horovodrun does, which this launcher does not",
            "pass -H hostfile (or -H host1:2,host2:2)",
        )
    if torchrun.explicit_nproc:
        raise LaunchError(
            "-np and --nproc-per-node were both given without -H",
            "-np N without hosts runs N processes on this machine, as horovodrun does: the same thing",
            "give one of them",
        )
    if not 1 <= ns.total_procs <= MAX_SLOTS:
        raise LaunchError(f"-np {ns.total_procs} is not a process count from 1 to {MAX_SLOTS}")
    return dataclasses.replace(
        torchrun, nproc_per_node=str(ns.total_procs), written=torchrun.written | {"-n"}
    )


def _ssh(ns: argparse.Namespace) -> SSHOptions:
    if ns.ssh_config is not None and not (
        Path(ns.ssh_config).is_file() and os.access(ns.ssh_config, os.R_OK)
    ):
        raise LaunchError(
            f"--ssh-config {ns.ssh_config}: cannot read it",
            "ssh -F stops at a config file it cannot read, on the first connection",
            "check the path (ssh reads it here, on this machine)",
        )
    return SSHOptions(
        port=None
        if ns.ssh_port is None
        else check_port("--ssh-port", ns.ssh_port, "give the hosts' sshd port, e.g. 22"),
        user=ns.ssh_user,
        config=ns.ssh_config,
        connect_timeout=int(
            check_seconds(
                "--connect-timeout", ns.connect_timeout, 0, "give whole seconds, e.g. 10 (the default)"
            )
        ),
        heartbeat_timeout=_heartbeat_timeout(ns.heartbeat_timeout),
    )


def _launcher_args(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as err:  # an unbalanced quote: "No closing quotation"
        raise LaunchError(
            f"--launcher-args {text[:80]!r}: {err}",
            "the string is split into arguments as a POSIX shell splits it",
            "close the quote, or escape it with a backslash",
        ) from None


def _check_layout(
    launcher: str, nnodes: tuple[int, int, int | None], nodes: list[Node] | None, nproc: str
) -> None:
    """What torchrun would refuse only in its agents, known here: 'gpu' processes on this machine
    without a GPU; and a rendezvous on port 0 (any free port), which works for one node only."""
    if LAUNCHERS[launcher].agents_here and not nodes and nproc == "gpu" and not torch.cuda.is_available():
        raise LaunchError(
            "--nproc-per-node gpu on a machine where torch sees no CUDA GPU",
            "torchrun starts one process per GPU it sees here, and refuses 'gpu' without one",
            "give a process count, or cpu (one process per CPU core)",
        )
    _, most, port = nnodes
    if port == 0 and (most > 1 or (nodes and len(nodes) > 1)):
        raise LaunchError(
            "--rdzv-endpoint with port 0 for a job on more than one node",
            "port 0 asks the system for any free port, which the other nodes cannot know",
            "give a port from 1 to 65535",
        )


def _ft_replicas(groups: int, nodes: list[Node] | None, nproc: str) -> int:
    if groups == 0:
        return 0
    if groups == 1 or groups < 0:
        raise LaunchError(
            f"--ft-replicas {groups}",
            "replica groups recover from each other: one group has nobody to heal from",
            "give 2 or more, or leave --ft-replicas out",
        )
    if nodes:
        why, most = (
            f"every replica group runs on nodes of its own, and the hosts are {len(nodes)}",
            len(nodes),
        )
    else:
        most = MAX_SLOTS // (count(nproc) or 1)
        why = f"each group starts its processes on this machine, and no machine runs more than {MAX_SLOTS}"
    in_range(
        "--ft-replicas", groups, 2, most, why=why, fix="give fewer groups, or spread them over nodes with -H"
    )
    return groups


def _world_size(
    launcher: str, nodes: list[Node] | None, flags: list[str], script: str, groups: int
) -> int | None:
    """The processes the engine counts, where the command line settles it (see ``LaunchRequest``)."""
    if LAUNCHERS[launcher].world_from_scheduler:
        return None  # srun: the allocation's size
    if nodes:
        sizes = [n.nproc for n in nodes]
        if groups and len(set(sizes)) > 1:
            return None  # each group counts its own nodes' processes
        return sum(sizes)
    if not LAUNCHERS[launcher].agents_here:
        return None
    # the flags torchrun gets here, read by its own parser: a platform's node count included
    final = get_args_parser().parse_args([*flags, script])
    per_node = count(final.nproc_per_node)
    if per_node is None or node_range(str(final.nnodes)) != (1, 1):
        return None
    return per_node * max(groups, 1)


def _heartbeat_timeout(seconds: int) -> int:
    if seconds < 3:
        raise LaunchError(
            f"--heartbeat-timeout {seconds}",
            "a heartbeat goes every second; under 3 s a busy moment on a node would end the job",
            "give 3 seconds or more (the default is 30)",
        )
    return int(check_seconds("--heartbeat-timeout", seconds, 0, "give 3 seconds or more (the default is 30)"))


def _check_script(ns: argparse.Namespace) -> None:
    script = Path(ns.training_script)
    if not (ns.module or ns.no_python or script.is_file()):
        raise LaunchError(
            f"training script {script} does not exist",
            f"it is resolved from the current directory, {Path.cwd()}",
            "check the path, or pass -m to run a module",
        )
    number = count(ns.nproc_per_node)
    if number is None and ns.nproc_per_node not in ("cpu", "gpu", "auto"):
        raise LaunchError(
            f"--nproc-per-node {str(ns.nproc_per_node)[:40]!r} is not a number",
            fix="give a process count, or one of auto, cpu, gpu",
        )
    if number is not None and not 1 <= number <= MAX_SLOTS:
        raise LaunchError(
            f"--nproc-per-node {number} is not a process count from 1 to {MAX_SLOTS}",
            fix="give the number of processes (GPUs) per node",
        )


def _nodes(ns: argparse.Namespace, torchrun: TorchrunArgs) -> list[Node] | None:
    if not ns.hostfile and ns.launcher and LAUNCHERS[ns.launcher].here_without_hosts:
        # every process on this machine (-np, or --nproc-per-node)
        total = ns.total_procs if ns.total_procs is not None else count(ns.nproc_per_node)
        if total is not None:
            if not 1 <= total <= MAX_SLOTS:
                raise LaunchError(f"-np {total} is not a process count from 1 to {MAX_SLOTS}")
            return [Node(host="localhost", slots=tuple(range(total)))]
    if not ns.hostfile:
        for flag, dest in (("--include", "include"), ("--exclude", "exclude"), ("--num_nodes", "num_nodes"),
                           ("--num_gpus", "num_gpus")):  # fmt: skip
            if getattr(ns, dest) is not None:
                raise LaunchError(f"{flag} needs hosts", fix="pass -H hostfile")
        return None
    # a bare host name takes --nproc-per-node when it is given (torchrun's default 1 is no choice)
    default = count(ns.nproc_per_node) if torchrun.explicit_nproc else None
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


def _apply_nproc(nodes: list[Node], torchrun: TorchrunArgs) -> list[Node]:
    """An explicit --nproc-per-node caps the slots every host uses."""
    n = count(torchrun.nproc_per_node)
    return select_nodes(nodes, num_gpus=n) if torchrun.explicit_nproc and n is not None else nodes


def _script_index(argv: list[str], script: str, script_args: list[str]) -> int:
    for i in range(len(argv) - len(script_args) - 1, -1, -1):
        if argv[i] == script and argv[i + 1 :] == script_args:
            return i
    raise LaunchError(f"cannot find the training script {script!r} in the command line")


def with_default_nproc(flags: list[str], nproc: int) -> list[str]:
    """``flags`` led by ``-n NPROC`` unless they choose a process count or hosts themselves: for
    jobs that need a process group to mean anything (`sail doctor`, `sail bench comm`)."""
    chosen = flag_names(flags) & {"-n", "--nproc-per-node"} or names_hosts(flags)
    return flags if chosen else ["-n", str(nproc), *flags]
