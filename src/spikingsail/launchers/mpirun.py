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

from spikingsail.errors import LaunchError
from spikingsail.launchers.as_torchrun import shimmed
from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.remote_env import remote_env
from spikingsail.launchers.request import LaunchRequest


class MpirunLauncher:
    name = "mpirun"

    @staticmethod
    def exists() -> bool:
        return shutil.which("mpirun") is not None

    def commands(self, request: LaunchRequest) -> list[LaunchCommand]:
        assert request.nodes, "parse_request gives multi-node launchers their nodes"
        custom = [n.host for n in request.nodes if n.slots != tuple(range(n.nproc))]
        if custom:
            raise LaunchError(
                f"--launcher mpirun cannot give {', '.join(custom)} a chosen set of slots",
                "mpirun starts the same command on every host, so every host uses its first N GPUs",
                "use --num_gpus instead of slot lists, or --launcher ssh",
            )
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
