"""What every cluster environment reduces to: one typed description of this process's place in the job."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from spikingsail.errors import RankDiscoveryError


class RankSource(str, Enum):
    """Which environment described the job; written as its value (``slurm``) in messages."""

    TORCHRUN = "torchrun"
    HOROVOD = "horovod"
    OPENMPI = "openmpi"
    SLURM = "slurm"
    ENV = "env"
    SINGLE = "single"

    def __str__(self) -> str:
        return self.value

    @property
    def own_rank_variables(self) -> bool:
        """The launcher describes ranks in variables of its own (SLURM_PROCID, OMPI_COMM_WORLD_RANK,
        HOROVOD_RANK): a RANK or WORLD_SIZE beside them was set by something else."""
        return self in (RankSource.SLURM, RankSource.OPENMPI, RankSource.HOROVOD)


@dataclass(kw_only=True, slots=True, frozen=True)
class RankInfo:
    """This process's place in the job, read once from the environment and passed explicitly."""

    rank: int
    """Global rank, 0 … world_size-1."""
    local_rank: int
    """Rank on this node; selects the GPU."""
    world_size: int
    local_world_size: int
    master_addr: str | None
    """Host of the rank-0 store; None only for a single process."""
    master_port: int | None
    source: RankSource
    """Which environment described the job (torchrun, horovod, slurm, openmpi, env, single)."""
    use_env_store: bool = False
    """The store at MASTER_ADDR:MASTER_PORT is hosted by torchrun's agent, not by rank 0."""
    restart_count: int = 0
    """How often torchrun's agent has restarted the workers (TORCHELASTIC_RESTART_COUNT)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", RankSource(self.source))  # also when given by its name
        if not 0 <= self.rank < self.world_size:
            raise RankDiscoveryError(
                f"{self.source}: rank {self.rank} is outside world size {self.world_size}",
                "a rank must be between 0 and world_size - 1",
                "check the variables your launcher sets (RANK / WORLD_SIZE or their SLURM / MPI equivalents)",
            )
        if not 0 <= self.local_rank < max(self.local_world_size, 1):
            raise RankDiscoveryError(
                f"{self.source}: local rank {self.local_rank} is outside local world size {self.local_world_size}",
                "the local rank selects the device on this node",
                "check LOCAL_RANK / LOCAL_WORLD_SIZE (or SLURM_LOCALID / OMPI_COMM_WORLD_LOCAL_RANK)",
            )
        if self.world_size > 1 and (not self.master_addr or self.master_port is None):
            raise RankDiscoveryError(
                f"{self.source}: {self.world_size} processes but no rendezvous address",
                "every rank must know where rank 0 listens (MASTER_ADDR and MASTER_PORT)",
                "export MASTER_ADDR and MASTER_PORT, or start the job with `sail launch`",
            )

    @classmethod
    def single(cls, local_rank: int = 0) -> RankInfo:
        """One process and no process group."""
        return cls(rank=0, local_rank=local_rank, world_size=1, local_world_size=max(local_rank + 1, 1),
                   master_addr=None, master_port=None, source=RankSource.SINGLE)  # fmt: skip

    @property
    def distributed(self) -> bool:
        """More than one process."""
        return self.world_size > 1

    @property
    def is_rank_zero(self) -> bool:
        """Whether this process is rank 0."""
        return self.rank == 0

    def init_method(self) -> str:
        """The rendezvous as a URL, ``tcp://MASTER_ADDR:MASTER_PORT``."""
        return f"tcp://{self.master_addr}:{self.master_port}"


class ClusterEnvironment(ABC):
    """Recognises one way of describing a job in environment variables and reads it."""

    name: RankSource

    @staticmethod
    @abstractmethod
    def detect(env: Mapping[str, str]) -> bool:
        """Whether ``env`` was set up by this kind of launcher."""

    @abstractmethod
    def read(self, env: Mapping[str, str]) -> RankInfo:
        """The rank information in ``env``; raises ``RankDiscoveryError`` when it is inconsistent."""


def int_var(env: Mapping[str, str], name: str, source: str) -> int:
    """An integer environment variable that must be present."""
    value = env.get(name)
    if value is None:
        raise RankDiscoveryError(
            f"{source}: {name} is not set",
            f"the other {source} variables are present, so the launcher is incomplete or was mixed with another",
            f"export {name}, or unset the partial {source} variables and use `sail launch`",
        )
    try:
        return int(value)
    except ValueError:
        raise RankDiscoveryError(f"{source}: {name}={value!r} is not an integer") from None


def port_var(env: Mapping[str, str], name: str, source: str) -> int | None:
    if name not in env:
        return None
    port = int_var(env, name, source)
    if not 0 < port < 65536:
        raise RankDiscoveryError(
            f"{source}: {name}={port} is not a TCP port", fix="use a port between 1 and 65535"
        )
    return port
