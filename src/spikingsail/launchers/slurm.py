"""SLURM: inside an allocation, srun starts the job on every allocated node.

Two modes, as in seed 002:

- ``torchrun`` (default): srun starts one torchrun agent per node; the agents meet in a c10d
  rendezvous on the first host of the allocation, at a port derived from the job id
  (``slurm_port``), under a rendezvous id made of the job id and a random part of this launch's.
- ``slurm`` (``--dist-init-method slurm``): srun starts one task per process (per GPU) and each
  task takes its rank from SLURM_PROCID / SLURM_LOCALID; no torchrun.

The same argv builders write the ``srun`` line of ``sail submit``'s sbatch scripts.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import uuid
from collections.abc import Mapping

from spikingsail.environments.slurm import Allocation, in_allocation
from spikingsail.errors import LaunchError
from spikingsail.launchers.as_torchrun import shimmed
from spikingsail.launchers.base import Launcher
from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.slurm_port import rendezvous_port
from spikingsail.launchers.spec import LaunchRequest

DIST_INIT_METHODS = ("torchrun", "slurm")


def torchrun_step(request: LaunchRequest, nnodes: str, nproc: str, endpoint: str, run_id: str) -> list[str]:
    """srun with one torchrun agent per node."""
    return [
        "srun", "--nodes", nnodes, "--ntasks-per-node", "1", "--kill-on-bad-exit=1",
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", nnodes, "--nproc-per-node", nproc,
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        *request.torchrun_args, request.script, *request.script_args,
    ]  # fmt: skip


def task_step(request: LaunchRequest, nnodes: str, nproc: str) -> list[str]:
    """srun with one task per process; ranks from SLURM_PROCID."""
    return [
        "srun", "--nodes", nnodes, "--ntasks-per-node", nproc, "--kill-on-bad-exit=1",
        *request.launcher_args, *shimmed(request),
    ]  # fmt: skip


def _relay(allocation: Allocation) -> list[str]:
    """Signals go to the job's tasks through slurmctld: srun itself would turn SIGTERM, SIGHUP and
    SIGQUIT into SIGKILL for the tasks (no checkpoint), and SIGINT into a status report. scancel
    without --batch leaves the batch shell, and salloc's, alone."""
    return ["sh", "-c", f'exec scancel --signal="$0" {shlex.quote(allocation.job_id)}']


class SlurmLauncher(Launcher):
    name = "slurm"
    needs_hosts = False  # the allocation's nodes
    world_from_scheduler = True
    install_hint = "apt-get install slurm-client"
    dist_init_methods = DIST_INIT_METHODS

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = os.environ if env is None else env

    @staticmethod
    def exists() -> bool:
        return shutil.which("srun") is not None

    def check(self, env: Mapping[str, str]) -> None:
        if not in_allocation(env):
            raise LaunchError(
                "--launcher slurm outside a SLURM allocation",
                "srun needs an allocation (SLURM_JOB_ID) to start the job in",
                "run inside salloc or an sbatch script, or use `sail submit` to write and submit one",
            )

    def commands(self, request: LaunchRequest) -> list[LaunchCommand]:
        allocation = Allocation.from_env(self.env)
        nproc = request.nproc_per_node if request.explicit_nproc else str(allocation.gpus_per_node or 1)
        nnodes = str(allocation.nodes)
        if request.dist_init_method == "slurm":
            argv = task_step(request, nnodes, nproc)
            env = {"MASTER_PORT": str(request.master_port)} if request.explicit_master_port else {}
        else:
            endpoint = request.rdzv_endpoint or f"{allocation.first_host}:{self._port(request, allocation)}"
            run_id = request.rdzv_id or f"{allocation.job_id}-{uuid.uuid4().hex[:8]}"
            argv = [*torchrun_step(request, nnodes, nproc, endpoint, run_id)]
            argv[1:1] = request.launcher_args
            env = {}
        return [
            LaunchCommand(host=f"slurm job {allocation.job_id}", argv=argv, env=env, relay=_relay(allocation))
        ]

    def _port(self, request: LaunchRequest, allocation: Allocation) -> int:
        if request.explicit_master_port:
            return request.master_port
        return rendezvous_port(self.env, allocation.first_host)
