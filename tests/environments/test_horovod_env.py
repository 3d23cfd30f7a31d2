"""Rank discovery for processes started by horovodrun (Gloo mode)."""

from __future__ import annotations

import pytest

from spikingsail.environments import discover_rank_info
from spikingsail.environments.horovod import store_agreed_by_horovod
from spikingsail.errors import RankDiscoveryError

# What horovodrun --gloo -np 4 -H node1:2,node2:2 gives the second process on node2.
HOROVODRUN = {
    "HOROVOD_HOSTNAME": "node2",
    "HOROVOD_RANK": "3",
    "HOROVOD_SIZE": "4",
    "HOROVOD_LOCAL_RANK": "1",
    "HOROVOD_LOCAL_SIZE": "2",
    "HOROVOD_CROSS_RANK": "1",
    "HOROVOD_CROSS_SIZE": "2",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.5",
    "HOROVOD_GLOO_RENDEZVOUS_PORT": "41234",
    "HOROVOD_CONTROLLER": "gloo",
    "HOROVOD_CPU_OPERATIONS": "gloo",
    "HOROVOD_GLOO_IFACE": "eth0",
}


def test_horovodrun_ranks() -> None:
    info = discover_rank_info(HOROVODRUN)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (3, 1, 4, 2)
    assert info.source == "horovod"
    # no MASTER_ADDR: the Horovod backend agrees on the torch.distributed store itself
    assert store_agreed_by_horovod(HOROVODRUN)
    assert (info.master_addr, info.master_port) == ("10.0.0.5", 41234)


def test_master_variables_exported_to_horovodrun_ranks_are_the_store() -> None:
    env = {**HOROVODRUN, "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}
    info = discover_rank_info(env)
    assert not store_agreed_by_horovod(env)
    assert info.init_method() == "tcp://node1:29500"


def test_torchrun_wins_over_inherited_horovod_variables() -> None:
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}  # fmt: skip
    assert discover_rank_info({**HOROVODRUN, **torchrun}).source == "torchrun"


def test_horovod_wins_over_mpi_and_plain_variables() -> None:
    env = {**HOROVODRUN, "OMPI_COMM_WORLD_RANK": "0", "RANK": "3", "WORLD_SIZE": "4"}
    assert discover_rank_info(env).source == "horovod"


def test_incomplete_horovod_variables() -> None:
    partial = {k: v for k, v in HOROVODRUN.items() if k != "HOROVOD_LOCAL_SIZE"}
    with pytest.raises(RankDiscoveryError, match=r"horovod: HOROVOD_LOCAL_SIZE is not set"):
        discover_rank_info(partial)
    no_rendezvous = {k: v for k, v in HOROVODRUN.items() if not k.startswith("HOROVOD_GLOO_RENDEZVOUS")}
    with pytest.raises(RankDiscoveryError, match=r"horovod: 4 processes but no rendezvous address"):
        discover_rank_info(no_rendezvous)


def test_one_horovod_process() -> None:
    env = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1"}
    info = discover_rank_info(env)
    assert (info.source, info.world_size, info.distributed) == ("horovod", 1, False)
