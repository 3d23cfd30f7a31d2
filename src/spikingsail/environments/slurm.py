"""SLURM's variables, read here only: the tasks srun started, one per process (seed 002's
``--dist-init-method slurm``), and the allocation that ``sail launch`` starts a job in."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import hostlist

from spikingsail.environments.base import ClusterEnvironment, RankInfo, RankSource, int_var, port_var
from spikingsail.errors import LaunchError, RankDiscoveryError


class SlurmEnvironment(ClusterEnvironment):
    name = RankSource.SLURM

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
            master_port=port_var(env, "MASTER_PORT", self.name) or job_port(env),
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

    def _tasks_on_this_node(self, env: Mapping[str, str], world_size: int) -> int:
        spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        if not spec:
            return world_size
        counts = hostlist.parse_slurm_tasks_per_node(spec)
        node = int(env.get("SLURM_NODEID", "0"))
        return int(counts[node]) if node < len(counts) else world_size


def job_id(env: Mapping[str, str]) -> str:
    """The SLURM job this process belongs to ("" outside SLURM)."""
    return env.get("SLURM_JOB_ID", "")


def job_port(env: Mapping[str, str]) -> int:
    """The job's port: every task of a job must agree on it without talking to the others, so it is
    derived from the job id, in a range clear of common services and of Linux's ephemeral ports."""
    return 15000 + int(env.get("SLURM_JOB_ID", "0")) % 15000


def in_allocation(env: Mapping[str, str]) -> bool:
    """Inside salloc or an sbatch script, but not inside a task that srun already started."""
    return "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env


@dataclass(kw_only=True, slots=True, frozen=True)
class Allocation:
    """The SLURM allocation (salloc, an sbatch script) that ``sail launch`` starts a job in."""

    job_id: str
    nodes: int
    first_host: str
    gpus_per_node: int | None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Allocation:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        try:
            hosts = hostlist.expand_hostlist(nodelist)
        except hostlist.BadHostlist:
            hosts = []
        if not hosts:
            raise LaunchError(
                f"SLURM allocation {env.get('SLURM_JOB_ID')} has no readable node list ({nodelist!r})"
            )
        return cls(
            job_id=env["SLURM_JOB_ID"],
            nodes=int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or len(hosts)),
            first_host=str(hosts[0]),
            gpus_per_node=_gpus_per_node(env),
        )


def _gpus_per_node(env: Mapping[str, str]) -> int | None:
    """The GPUs of one node of the allocation: SLURM_GPUS_ON_NODE; else GPUs per task × tasks per
    node (``--ntasks-per-node=4 --gpus-per-task=1`` is four GPUs a node, not one); else
    ``--gpus-per-node`` (``4`` or ``a100:4``)."""
    on_node = _count(env.get("SLURM_GPUS_ON_NODE"))
    per_task, tasks = _count(env.get("SLURM_GPUS_PER_TASK")), _count(env.get("SLURM_NTASKS_PER_NODE"))
    if on_node:
        return on_node
    if per_task:
        return per_task * (tasks or 1)
    return _count(env.get("SLURM_GPUS_PER_NODE"))


def _count(value: str | None) -> int | None:
    """A count as Slurm writes it, with an optional GPU type (``a100:4``)."""
    found = re.fullmatch(r"(?:[A-Za-z0-9_.-]+:)?([0-9]{1,6})", value or "")
    return int(found[1]) if found else None
