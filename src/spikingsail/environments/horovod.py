"""Processes started by horovodrun (Gloo mode): ranks from HOROVOD_RANK, HOROVOD_SIZE and friends.

horovodrun ``--gloo`` gives every process HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK,
HOROVOD_LOCAL_SIZE, HOROVOD_CROSS_RANK/SIZE, HOROVOD_HOSTNAME and the address of its own rendezvous
server (HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT), but no MASTER_ADDR. torch.distributed's store address
then comes from:

- MASTER_ADDR and MASTER_PORT when they are set (``sail launch --launcher horovodrun`` exports them;
  every backend then works under horovodrun);
- otherwise from the Horovod backend itself, which agrees on one through Horovod after ``hvd.init()``
  (``RankInfo`` names horovodrun's rendezvous server meanwhile; only the Horovod backend can start
  from that). ``store_agreed_by_horovod`` tells which case this is.

``horovodrun --mpi`` describes processes with Open MPI's variables instead (``OpenMPIEnvironment``).
"""

from __future__ import annotations

from collections.abc import Mapping

from spikingsail.environments.base import ClusterEnvironment, RankInfo, RankSource, int_var, port_var

RANK_VARS = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE")


def store_agreed_by_horovod(env: Mapping[str, str]) -> bool:
    """True when horovodrun started this process without MASTER_ADDR/MASTER_PORT."""
    return "HOROVOD_RANK" in env and not ("MASTER_ADDR" in env and "MASTER_PORT" in env)


class HorovodEnvironment(ClusterEnvironment):
    name = RankSource.HOROVOD

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "HOROVOD_RANK" in env

    def read(self, env: Mapping[str, str]) -> RankInfo:
        if store_agreed_by_horovod(env):
            addr = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
            port = port_var(env, "HOROVOD_GLOO_RENDEZVOUS_PORT", self.name)
        else:
            addr = env["MASTER_ADDR"]
            port = port_var(env, "MASTER_PORT", self.name)
        return RankInfo(
            rank=int_var(env, "HOROVOD_RANK", self.name),
            local_rank=int_var(env, "HOROVOD_LOCAL_RANK", self.name),
            world_size=int_var(env, "HOROVOD_SIZE", self.name),
            local_world_size=int_var(env, "HOROVOD_LOCAL_SIZE", self.name),
            master_addr=addr,
            master_port=port,
            source=self.name,
        )
