"""Launchers turn a launch request into commands (host, argv, env) before anything runs.

Each launcher is one class in a file of its own (``base.Launcher``: its facts, its checks, its
commands); ``LAUNCHERS`` below is the one place that names them.
"""

from __future__ import annotations

from collections.abc import Mapping

from spikingsail.environments.slurm import in_allocation
from spikingsail.errors import LaunchError
from spikingsail.launchers.base import Launcher
from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.horovodrun import HorovodrunLauncher
from spikingsail.launchers.local import LocalLauncher
from spikingsail.launchers.mpirun import MpirunLauncher
from spikingsail.launchers.pdsh import PdshLauncher
from spikingsail.launchers.slurm import SlurmLauncher
from spikingsail.launchers.spec import LaunchRequest
from spikingsail.launchers.ssh import SSHLauncher

LAUNCHERS: dict[str, type[Launcher]] = {
    launcher.name: launcher
    for launcher in (
        LocalLauncher,
        SSHLauncher,
        PdshLauncher,
        MpirunLauncher,
        SlurmLauncher,
        HorovodrunLauncher,
    )
}


def default_launcher(has_hosts: bool, env: Mapping[str, str]) -> str:
    """Without ``--launcher``: ssh to the hosts of ``-H``, else srun inside a SLURM allocation,
    else this machine."""
    return "ssh" if has_hosts else "slurm" if in_allocation(env) else "local"


def launcher_for(request: LaunchRequest) -> Launcher:
    return LAUNCHERS[request.launcher]()


def plan(request: LaunchRequest) -> list[LaunchCommand]:
    launcher = LAUNCHERS[request.launcher]
    if not launcher.exists():
        raise LaunchError(
            f"--launcher {request.launcher}: the {request.launcher} command is not installed here",
            fix=f"install it ({launcher.install_hint}) or choose another --launcher",
        )
    return launcher().commands(request)
