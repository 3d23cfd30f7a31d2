"""Rank discovery from every environment, and the combinations that must be refused."""

from __future__ import annotations

import pytest

from spikingsail.environments import discover_rank_info
from spikingsail.errors import RankDiscoveryError

TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "abc",
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node1",
    "MASTER_PORT": "29500",
}
SLURM = {
    "SLURM_PROCID": "3",
    "SLURM_STEP_ID": "0",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_NODEID": "1",
    "SLURM_JOB_ID": "1234",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_TASKS_PER_NODE": "2(x2)",
}
OMPI = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
}


def test_no_environment_is_one_process() -> None:
    info = discover_rank_info({})
    assert (info.rank, info.world_size, info.distributed, info.source) == (0, 1, False, "single")


def test_torchrun() -> None:
    info = discover_rank_info(TORCHRUN)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (3, 1, 4, 2)
    assert info.source == "torchrun" and info.restart_count == 0


def test_slurm_task_per_process() -> None:
    info = discover_rank_info(SLURM)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (3, 1, 4, 2)
    assert info.master_addr == "gpu07"
    assert info.master_port == 15000 + 1234
    assert info.init_method() == "tcp://gpu07:16234"


def test_slurm_master_can_be_overridden() -> None:
    info = discover_rank_info({**SLURM, "MASTER_ADDR": "login", "MASTER_PORT": "23445"})
    assert (info.master_addr, info.master_port) == ("login", 23445)


def test_slurm_batch_script_itself_is_a_single_process() -> None:
    batch_step = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert discover_rank_info(batch_step).source == "single"


def test_openmpi() -> None:
    info = discover_rank_info(OMPI)
    assert (info.rank, info.local_rank, info.world_size, info.source) == (2, 0, 4, "openmpi")
    assert info.init_method() == "tcp://10.0.0.1:29400"


def test_torchrun_inside_slurm_uses_torchrun() -> None:
    # srun torchrun ...: SLURM_PROCID is the node's index, torchrun's RANK is the process's.
    info = discover_rank_info({**SLURM, **TORCHRUN})
    assert (info.source, info.rank) == ("torchrun", 3)


def test_plain_env_vars_with_legacy_local_rank_argument() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29544"}
    info = discover_rank_info(env, local_rank_arg=1)
    assert (info.source, info.rank, info.local_rank) == ("env", 1, 1)


def refused(env: dict[str, str], local_rank_arg: int | None = None) -> str:
    with pytest.raises(RankDiscoveryError) as err:
        discover_rank_info(env, local_rank_arg=local_rank_arg)
    return str(err.value)


def test_rank_beyond_world_size() -> None:
    assert "rank 4 is outside world size 4" in refused({**TORCHRUN, "RANK": "4"})


def test_rank_without_world_size() -> None:
    message = refused({"RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"})
    assert "WORLD_SIZE is not set" in message


def test_missing_master_address() -> None:
    assert "no rendezvous address" in refused({"RANK": "0", "WORLD_SIZE": "2"})


def test_slurm_and_a_contradicting_rank() -> None:
    message = refused({**SLURM, "RANK": "0", "WORLD_SIZE": "4"})
    assert "RANK=0 contradicts slurm, which says 3" in message


def test_platform_node_count_under_mpirun() -> None:
    assert "WORLD_SIZE=2 contradicts openmpi, which says 4" in refused({**OMPI, "WORLD_SIZE": "2"})


def test_local_rank_argument_contradicts_environment() -> None:
    assert "--local_rank=0 contradicts the local rank 1" in refused(TORCHRUN, local_rank_arg=0)


def test_non_integer_and_bad_port() -> None:
    assert "RANK='x' is not an integer" in refused({**TORCHRUN, "RANK": "x"})
    assert "MASTER_PORT=70000 is not a TCP port" in refused({**TORCHRUN, "MASTER_PORT": "70000"})


def test_bad_slurm_nodelist() -> None:
    assert "cannot expand the node list" in refused({**SLURM, "SLURM_JOB_NODELIST": "gpu[07-"})
