"""Plain env:// variables: torch.distributed.launch, mp.spawn scripts, platforms that inject them."""

from __future__ import annotations

from collections.abc import Mapping

from spikingsail.environments.base import ClusterEnvironment, RankInfo, RankSource, int_var, port_var


class EnvVarEnvironment(ClusterEnvironment):
    """RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set by something other than torchrun.

    LOCAL_RANK may come from the environment or, for the legacy ``torch.distributed.launch``,
    from the ``--local_rank`` argument it appends.
    """

    name = RankSource.ENV

    def __init__(self, local_rank_arg: int | None = None) -> None:
        self.local_rank_arg = local_rank_arg

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "RANK" in env or "WORLD_SIZE" in env

    def read(self, env: Mapping[str, str]) -> RankInfo:
        world_size = int_var(env, "WORLD_SIZE", self.name)
        if "LOCAL_RANK" in env:
            local_rank = int_var(env, "LOCAL_RANK", self.name)
        else:
            local_rank = self.local_rank_arg if self.local_rank_arg is not None else 0
        return RankInfo(
            rank=int_var(env, "RANK", self.name),
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
            master_addr=env.get("MASTER_ADDR"),
            master_port=port_var(env, "MASTER_PORT", self.name),
            source=self.name,
        )
