"""Open MPI's mpirun: one process per slot, started by mpirun's own daemons over ssh.

There is no torchrun agent here: ranks come from OMPI_COMM_WORLD_* and the engine's process group
meets at MASTER_ADDR (the first host) and MASTER_PORT, exported to every rank with ``-x``; a plain
torchrun script gets torchrun's variables too (``as_torchrun``). mpirun stops every rank when one
fails.
"""

from __future__ import annotations

import os
import shlex
import shutil

from spikingsail.launchers.as_torchrun import shimmed
from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.remote_env import remote_env
from spikingsail.launchers.request import LaunchRequest, require_first_slots


class MpirunLauncher:
    name = "mpirun"

    @staticmethod
    def exists() -> bool:
        return shutil.which("mpirun") is not None

    def commands(self, request: LaunchRequest) -> list[LaunchCommand]:
        require_first_slots(request, "mpirun")
        assert request.nodes  # checked there
        env = {
            **remote_env(request.env),
            "MASTER_ADDR": request.nodes[0].host,
            "MASTER_PORT": str(request.master_port),
        }
        argv = ["mpirun"]
        if os.geteuid() == 0:
            argv.append("--allow-run-as-root")  # Open MPI refuses root unless told; containers run as root
        argv += [
            "-np", str(sum(n.nproc for n in request.nodes)),
            "--host", ",".join(f"{n.host}:{n.nproc}" for n in request.nodes),
            "--mca", "plm_rsh_args", shlex.join(request.ssh.args()),
            "--wdir", os.getcwd(),
        ]  # fmt: skip
        for key, value in sorted(env.items()):
            argv += ["-x", f"{key}={value}"]
        argv += [*request.launcher_args, *shimmed(request)]
        return [LaunchCommand(host=",".join(n.host for n in request.nodes), argv=argv)]
