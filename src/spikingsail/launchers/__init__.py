"""Launchers turn a launch request into commands (host, argv, env) before anything runs."""

from __future__ import annotations

from typing import Protocol

from spikingsail.errors import LaunchError
from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.horovodrun import INSTALL_HINT as HOROVOD_INSTALL_HINT
from spikingsail.launchers.horovodrun import HorovodrunLauncher
from spikingsail.launchers.local import LocalLauncher
from spikingsail.launchers.mpirun import MpirunLauncher
from spikingsail.launchers.pdsh import PdshLauncher
from spikingsail.launchers.request import LaunchRequest
from spikingsail.launchers.slurm import SlurmLauncher
from spikingsail.launchers.ssh import SSHLauncher


class Launcher(Protocol):
    name: str

    def commands(self, request: LaunchRequest) -> list[LaunchCommand]: ...


_LAUNCHERS: dict[str, type[Launcher]] = {
    "local": LocalLauncher,
    "ssh": SSHLauncher,
    "pdsh": PdshLauncher,
    "mpirun": MpirunLauncher,
    "slurm": SlurmLauncher,
    "horovodrun": HorovodrunLauncher,
}
_INSTALL = {
    "ssh": "apt-get install openssh-client",
    "pdsh": "apt-get install pdsh",
    "mpirun": "apt-get install openmpi-bin",
    "slurm": "apt-get install slurm-client",
    "horovodrun": HOROVOD_INSTALL_HINT,
}


def plan(request: LaunchRequest) -> list[LaunchCommand]:
    launcher = _LAUNCHERS[request.launcher]
    exists = getattr(launcher, "exists", None)
    if exists is not None and not exists():
        raise LaunchError(
            f"--launcher {request.launcher}: the {request.launcher} command is not installed here",
            fix=f"install it ({_INSTALL[request.launcher]}) or choose another --launcher",
        )
    return launcher().commands(request)
