"""Processes started by Open MPI's mpirun (one process per slot)."""

from __future__ import annotations

from collections.abc import Mapping

from spikingsail.environments.base import ClusterEnvironment, RankInfo, RankSource, int_var, port_var


class OpenMPIEnvironment(ClusterEnvironment):
    """Ranks from OMPI_COMM_WORLD_*; the store address from MASTER_ADDR / MASTER_PORT (``mpirun -x``)."""

    name = RankSource.OPENMPI

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "OMPI_COMM_WORLD_RANK" in env

    def read(self, env: Mapping[str, str]) -> RankInfo:
        return RankInfo(
            rank=int_var(env, "OMPI_COMM_WORLD_RANK", self.name),
            local_rank=int_var(env, "OMPI_COMM_WORLD_LOCAL_RANK", self.name),
            world_size=int_var(env, "OMPI_COMM_WORLD_SIZE", self.name),
            local_world_size=int_var(env, "OMPI_COMM_WORLD_LOCAL_SIZE", self.name),
            master_addr=env.get("MASTER_ADDR"),
            master_port=port_var(env, "MASTER_PORT", self.name),
            source=self.name,
        )
