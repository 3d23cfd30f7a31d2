"""Rank discovery: every way a job can be described in environment variables, read in one place.

``discover_rank_info()`` picks the environment that launched this process (torchrun, horovodrun,
Open MPI, SLURM, plain env:// variables, or none: a single process) and returns one ``RankInfo``.
Contradicting variables are an error, not a guess.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from spikingsail.environments.base import ClusterEnvironment, RankInfo, RankSource
from spikingsail.environments.env_vars import EnvVarEnvironment
from spikingsail.environments.horovod import HorovodEnvironment
from spikingsail.environments.openmpi import OpenMPIEnvironment
from spikingsail.environments.slurm import SlurmEnvironment
from spikingsail.environments.torchrun import TorchrunEnvironment
from spikingsail.errors import RankDiscoveryError

__all__ = ["ClusterEnvironment", "RankInfo", "RankSource", "discover_rank_info"]


def discover_rank_info(env: Mapping[str, str] | None = None, local_rank_arg: int | None = None) -> RankInfo:
    """Read this process's rank information.

    ``local_rank_arg`` is the ``--local_rank`` / ``--local-rank`` value that the legacy
    ``torch.distributed.launch`` passes on the command line (None when absent).
    """
    env = os.environ if env is None else env
    environments: list[ClusterEnvironment] = [
        TorchrunEnvironment(),
        HorovodEnvironment(),
        OpenMPIEnvironment(),
        SlurmEnvironment(),
        EnvVarEnvironment(local_rank_arg),
    ]
    chosen = next((e for e in environments if e.detect(env)), None)
    info = RankInfo.single(local_rank_arg or 0) if chosen is None else chosen.read(env)
    _check_agreement(info, env, local_rank_arg)
    return info


def _check_agreement(info: RankInfo, env: Mapping[str, str], local_rank_arg: int | None) -> None:
    """Variables from another launcher that contradict the chosen one mean a mixed-up launch."""
    if info.source.own_rank_variables:
        for var, value in (("RANK", info.rank), ("WORLD_SIZE", info.world_size)):
            if var in env and env[var] != str(value):
                raise RankDiscoveryError(
                    f"{var}={env[var]} contradicts {info.source}, which says {value}",
                    f"{info.source} started this process, but {var} was set by something else "
                    "(an exported variable, or a platform that counts nodes, not processes)",
                    f"unset {var} before starting the job, or start it with `sail launch`",
                )
    if local_rank_arg is not None and local_rank_arg != info.local_rank:
        raise RankDiscoveryError(
            f"--local_rank={local_rank_arg} contradicts the local rank {info.local_rank} from {info.source}",
            "two launchers are describing this process",
            "drop --local_rank (torchrun sets LOCAL_RANK), or launch with a single launcher",
        )
