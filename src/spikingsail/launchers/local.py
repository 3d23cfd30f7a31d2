"""Local multi-process launch: torchrun's elastic agent on this machine.

``sail launch`` accepts torchrun's own flags (parsed by torchrun's parser, so they mean exactly
what they mean to torchrun) plus ``-n`` for ``--nproc-per-node`` and ``--dry-run``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.run import get_args_parser

from spikingsail.errors import LaunchError
from spikingsail.launchers.command import LaunchCommand, python_module

_OWN_FLAGS = {"-n": 1, "--dry-run": 0}


@dataclass(kw_only=True, slots=True, frozen=True)
class LocalLaunch:
    """A validated local launch: torchrun's flags, the script and its arguments."""

    torchrun_args: list[str]
    script: str
    script_args: list[str]
    nproc_per_node: str
    dry_run: bool

    def commands(self) -> list[LaunchCommand]:
        argv = python_module("torch.distributed.run", *self.torchrun_args, self.script, *self.script_args)
        return [LaunchCommand(host="localhost", argv=argv)]


def parser() -> argparse.ArgumentParser:
    p = get_args_parser()
    p.prog = "sail launch"
    p.description = "Start a training script on this machine under torchrun's elastic agent."
    p.add_argument(
        "-n",
        dest="nproc_per_node",
        default=argparse.SUPPRESS,
        help="processes on this node (same as --nproc-per-node)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    return p


def parse_launch(argv: list[str]) -> LocalLaunch:
    namespace = parser().parse_args(argv)
    script = Path(namespace.training_script)
    if not (namespace.module or namespace.no_python or script.is_file()):
        raise LaunchError(
            f"training script {script} does not exist",
            f"it is resolved from the current directory, {Path.cwd()}",
            "check the path, or pass -m to run a module",
        )
    split = _script_index(argv, namespace.training_script, namespace.training_script_args)
    head = _without_own_flags(argv[:split])
    if "-n" in argv[:split] or any(a.startswith("-n") and a[2:].isdigit() for a in argv[:split]):
        head = ["--nproc-per-node", str(namespace.nproc_per_node), *head]
    if _single_node(namespace, head):
        # torchrun's default static rendezvous binds port 29500: two jobs on one machine would
        # collide. --standalone picks a free port for a single-node job.
        head = ["--standalone", *head]
    if not str(namespace.nproc_per_node).isdigit() and namespace.nproc_per_node not in ("cpu", "gpu", "auto"):
        raise LaunchError(
            f"--nproc-per-node {namespace.nproc_per_node!r} is not a number",
            fix="give a process count, or one of auto, cpu, gpu",
        )
    return LocalLaunch(
        torchrun_args=head,
        script=namespace.training_script,
        script_args=list(namespace.training_script_args),
        nproc_per_node=str(namespace.nproc_per_node),
        dry_run=namespace.dry_run,
    )


def _script_index(argv: list[str], script: str, script_args: list[str]) -> int:
    for i in range(len(argv) - len(script_args) - 1, -1, -1):
        if argv[i] == script and argv[i + 1 :] == script_args:
            return i
    raise LaunchError(f"cannot find the training script {script!r} in the command line")


def _without_own_flags(head: list[str]) -> list[str]:
    out: list[str] = []
    skip = 0
    for arg in head:
        if skip:
            skip -= 1
        elif arg in _OWN_FLAGS:
            skip = _OWN_FLAGS[arg]
        elif not (arg.startswith("-n") and arg[2:].isdigit()):
            out.append(arg)
    return out


def _single_node(namespace: argparse.Namespace, head: list[str]) -> bool:
    explicit_port = any(a.split("=")[0] in ("--master-port", "--master_port") for a in head)
    return (
        str(namespace.nnodes) in ("1", "1:1")
        and not namespace.rdzv_endpoint
        and not namespace.standalone
        and not explicit_port
    )
