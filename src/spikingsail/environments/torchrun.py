"""torchrun / torch.distributed.run workers (also under `sail launch`, which runs torchrun)."""

from __future__ import annotations

from collections.abc import Mapping

from spikingsail.environments.base import ClusterEnvironment, RankInfo, RankSource, int_var, port_var


class TorchrunEnvironment(ClusterEnvironment):
    name = RankSource.TORCHRUN

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        # The elastic agent sets TORCHELASTIC_RUN_ID for every worker it starts.
        return "TORCHELASTIC_RUN_ID" in env

    def read(self, env: Mapping[str, str]) -> RankInfo:
        return RankInfo(
            rank=int_var(env, "RANK", self.name),
            local_rank=int_var(env, "LOCAL_RANK", self.name),
            world_size=int_var(env, "WORLD_SIZE", self.name),
            local_world_size=int_var(env, "LOCAL_WORLD_SIZE", self.name),
            master_addr=env.get("MASTER_ADDR"),
            master_port=port_var(env, "MASTER_PORT", self.name),
            source=self.name,
            use_env_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )
