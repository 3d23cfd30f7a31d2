"""SLURM tasks started by srun, one task per process (seed 002's ``--dist-init-method slurm``)."""

from __future__ import annotations

from collections.abc import Mapping

import hostlist

from spikingsail.environments.base import ClusterEnvironment, RankInfo, int_var, port_var
from spikingsail.errors import RankDiscoveryError


class SlurmEnvironment(ClusterEnvironment):
    name = "slurm"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        # SLURM_STEP_ID marks a task that srun started. A batch script also has SLURM_PROCID=0
        # and SLURM_NTASKS=N, and salloc's shell has SLURM_NTASKS=N, but each is one process:
        # taking it for rank 0 of N would hang.
        return "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env

    def read(self, env: Mapping[str, str]) -> RankInfo:
        world_size = int_var(env, "SLURM_NTASKS", self.name)
        return RankInfo(
            rank=int_var(env, "SLURM_PROCID", self.name),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            world_size=world_size,
            local_world_size=self._tasks_on_this_node(env, world_size),
            master_addr=env.get("MASTER_ADDR") or self._first_host(env),
            master_port=port_var(env, "MASTER_PORT", self.name) or self._job_port(env),
            source=self.name,
        )

    def _first_host(self, env: Mapping[str, str]) -> str | None:
        nodelist = (
            env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        )
        if not nodelist:
            return None
        try:
            return str(hostlist.expand_hostlist(nodelist)[0])
        except hostlist.BadHostlist as err:
            raise RankDiscoveryError(
                f"slurm: cannot expand the node list {nodelist!r}", str(err), "set MASTER_ADDR explicitly"
            ) from None

    def _job_port(self, env: Mapping[str, str]) -> int:
        # Every task of a job must agree on the port without talking to each other: derive it from
        # the job id, in a range clear of common services and of Linux's ephemeral ports.
        return 15000 + int(env.get("SLURM_JOB_ID", "0")) % 15000

    def _tasks_on_this_node(self, env: Mapping[str, str], world_size: int) -> int:
        spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        if not spec:
            return world_size
        counts = hostlist.parse_slurm_tasks_per_node(spec)
        node = int(env.get("SLURM_NODEID", "0"))
        return int(counts[node]) if node < len(counts) else world_size


def in_allocation(env: Mapping[str, str]) -> bool:
    """Inside salloc or an sbatch script, but not inside a task that srun already started."""
    return "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env
