"""What ``sail launch --ft-replicas`` plans (the lighthouse, one torchrun agent per group, their GPUs
and nodes) and what replica groups refuse, checked without starting them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from spikingsail.errors import ConfigError, LaunchError
from spikingsail.launchers.replicas import ReplicaPlan, plan_replica_groups
from spikingsail.launchers.request import parse_request


@pytest.mark.parametrize(
    ("flags", "restarts"),
    [([], 3), (["--max-restarts", "0"], 0), (["--max_restarts=1"], 1), (["--max-re", "0"], 0)],
)
def test_replica_groups_are_started_again_unless_the_command_line_bounds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str], restarts: int
) -> None:
    """--ft-replicas asks for recovery: without --max-restarts a failed group is started again up to
    3 times; any spelling of --max-restarts torchrun's parser takes (an abbreviation too) bounds it."""
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text("")
    assert parse_request([*flags, "--ft-replicas", "2", "train.py"]).max_restarts == restarts
    assert parse_request([*flags, "train.py"]).max_restarts == (0 if not flags else restarts)


def test_launch_plans_the_lighthouse_and_one_agent_per_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    script = tmp_path / "train.py"
    script.touch()
    request = parse_request(
        ["--ft-replicas", "3", "-n", "2", "--max-restarts", "2", str(script), "--lr", "1"]
    )
    plan = ReplicaPlan(groups=3, heartbeat_timeout_ms=1000, join_timeout_ms=10000, lighthouse_port=29999)
    lighthouse, *groups = plan_replica_groups(request, plan)
    assert lighthouse.argv[0] == sys.executable and Path(lighthouse.argv[1]).name == "torchft_lighthouse.py"
    assert lighthouse.argv[lighthouse.argv.index("--bind") + 1] == "127.0.0.1:29999"
    assert [c.env["REPLICA_GROUP_ID"] for c in groups] == ["0", "1", "2"]
    secret = groups[0].env["SAIL_REPLICA_SECRET"]
    assert (
        len(bytes.fromhex(secret)) == 32 and secret != ReplicaPlan(3, 1000, 10000, 29999).secret
    )  # one per job
    for command in groups:
        assert command.env["SAIL_REPLICA_SECRET"] == secret  # in the environment only
        assert secret not in " ".join(command.argv) and secret not in command.render()
        assert command.env["NUM_REPLICA_GROUPS"] == "3"
        assert command.env["TORCHFT_LIGHTHOUSE"] == "http://127.0.0.1:29999"
        assert command.argv[1:3] == ["-m", "torch.distributed.run"]
        assert {"--standalone", "--max-restarts"} <= set(command.argv)
        assert command.argv[-3:] == [str(script), "--lr", "1"]
        # six processes on this machine: one thread each, as torchrun sets for several per node
        assert command.env["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the shell's choice stands
    assert all("OMP_NUM_THREADS" not in c.env for c in plan_replica_groups(request, plan)[1:])


def test_each_group_on_this_machine_trains_on_gpus_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group's processes take the GPUs of their local ranks, numbered from 0 in every group: each
    group gets its own slice of the machine's GPUs (of the shell's mask, when it sets one), and a
    machine with too few GPUs for a process each is refused before anything starts."""
    from spikingsail.backends import process_group

    script = tmp_path / "train.py"
    script.touch()
    plan = ReplicaPlan(groups=2, heartbeat_timeout_ms=1000, join_timeout_ms=10000, lighthouse_port=29999)

    def masks(*argv: str) -> list[str | None]:
        groups = plan_replica_groups(parse_request(["--ft-replicas", "2", *argv, str(script)]), plan)[1:]
        return [c.env.get("CUDA_VISIBLE_DEVICES") for c in groups]

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(process_group, "nvidia_gpus", lambda: 0)
    assert masks("-n", "2") == [None, None]  # a CPU machine: nothing to divide
    monkeypatch.setattr(process_group, "nvidia_gpus", lambda: 4)
    assert masks("-n", "2") == ["0,1", "2,3"]
    assert masks("-n", "1") == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert masks("-n", "2") == ["4,5", "6,7"]
    with pytest.raises(
        LaunchError, match=r"(?s)which shows 4 GPU\(s\) \(CUDA_VISIBLE_DEVICES=4,5,6,7\).*at most 2 here"
    ):
        masks("-n", "3")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(LaunchError, match="--nproc-per-node gpu"):
        masks("--nproc-per-node", "gpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(
        LaunchError, match=r"(?s)shows 1 GPU.*fix: spread the groups over nodes with -H \(or hide"
    ):
        masks("-n", "1")  # fewer GPUs than groups: no process count fits
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # GPUs hidden on purpose: the CPU
    assert masks("-n", "3") == [None, None]
    monkeypatch.setattr(process_group, "nvidia_gpus", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # a mask on a machine without GPUs: the CPU
    assert masks("-n", "3") == [None, None]


def test_the_lighthouse_address_is_this_machines_towards_the_nodes() -> None:
    from spikingsail.launchers.replicas import address_towards

    assert address_towards(["localhost", "127.0.0.2"]) == "127.0.0.1"  # nodes on this machine's loopback
    with pytest.raises(LaunchError, match="do not resolve here"):
        address_towards(["no-such-node.invalid"])


def test_launch_spreads_the_groups_over_the_hostfile_nodes(tmp_path: Path) -> None:
    """With -H each group is the multi-node job of a slice of the nodes, with its own rendezvous,
    and the lighthouse listens on the address the nodes reach this machine at."""
    from spikingsail.launchers import plan
    from spikingsail.launchers.replicas import ENV_GROUP_REQUEST, decode_request, group_requests

    script = tmp_path / "train.py"
    script.touch()
    request = parse_request(["--ft-replicas", "2", "-H", "n1:2,n2:2,n3:2,n4:2", "--max-restarts", "2",
                             "--env", "HF_TOKEN=secret", str(script)])  # fmt: skip
    replicas = ReplicaPlan(2, 1000, 10000, 29999, lighthouse_host="10.0.0.9")
    lighthouse, *children = plan_replica_groups(request, replicas)
    assert lighthouse.argv[lighthouse.argv.index("--bind") + 1] == "10.0.0.9:29999"
    subs = [decode_request(c.env[ENV_GROUP_REQUEST]) for c in children]
    assert subs == group_requests(request, replicas)
    assert all("secret" not in " ".join(c.argv) for c in children)  # --env values stay off command lines
    assert [[n.host for n in sub.nodes or []] for sub in subs] == [["n1", "n2"], ["n3", "n4"]]
    for group, sub in enumerate(subs):
        assert sub.ft_replicas == 0 and sub.max_restarts == 2
        assert sub.env["REPLICA_GROUP_ID"] == str(group) and sub.env["NUM_REPLICA_GROUPS"] == "2"
        assert sub.env["TORCHFT_LIGHTHOUSE"] == "http://10.0.0.9:29999"
        assert sub.env["HF_TOKEN"] == "secret"
        assert sub.env["SAIL_REPLICA_SECRET"] == replicas.secret  # shipped in the nodes' 0600 file
        commands = plan(sub)
        assert any(replicas.secret in str(upload.env) for c in commands for upload in c.uploads)
        assert not any(replicas.secret in " ".join(c.argv) for c in commands)
        agents = " ".join(command.render() for command in commands)
        first = (sub.nodes or [])[0].host
        assert f"--rdzv-endpoint {first}:29500" in agents and "--nnodes 2" in agents


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--ft-replicas", "1"], "one group has nobody to heal from"),
     (["--ft-replicas", "2", "-H", "a:1,b:1,c:1"], "the same number of nodes each"),
     (["--ft-replicas", "2", "-H", "a:1,b:1", "--launcher", "mpirun"], "torchrun agents of its own"),
     (["--ft-replicas", "2", "-H", "a:1,b:1", "--rdzv-endpoint", "a:2"], "a rendezvous of its own"),
     (["--ft-replicas", "2", "--ft-heartbeat-timeout", "0"], "a time in seconds")],
)  # fmt: skip
def test_launch_refuses_what_it_cannot_do(tmp_path: Path, argv: list[str], message: str) -> None:
    script = tmp_path / "train.py"
    script.touch()

    def plan() -> None:
        plan_replica_groups(parse_request([*argv, str(script)]), ReplicaPlan(2, 1000, 10000, 29999))

    with pytest.raises(LaunchError, match=message):
        plan()


@pytest.mark.parametrize(
    ("config", "backend", "message"),
    [({}, "deepspeed", "only the ddp and fsdp backends"),
     ({"fp16": {"enabled": True}}, "ddp", "loss scaler that skips a step"),
     ({"zero_optimization": {"stage": 1}}, "ddp", "ZeRO-1 over ddp shards it on its own"),
     ({"sail": {"balance": [1, 1]}}, "ddp", "follow the groups taking part")],
)  # fmt: skip
def test_what_replica_groups_cannot_keep_exact_is_refused(
    config: dict[str, Any], backend: str, message: str
) -> None:
    from spikingsail.config.parse import load_config
    from spikingsail.engine.replicas import check_supported

    with pytest.raises(ConfigError, match=message):
        check_supported(load_config({"train_micro_batch_size_per_gpu": 1, **config}, 2), backend)


def test_synchronised_batch_norm_is_refused_with_replica_groups_and_plain_batch_norm_is_not() -> None:
    from spikingsail.config.parse import load_config
    from spikingsail.engine.initialize import synchronised_batch_norm
    from spikingsail.engine.replicas import check_supported
    from spikingsail.snn import convert_sync_batchnorm

    plain = {"train_micro_batch_size_per_gpu": 1}
    cases = [({"snn": {"sync_batchnorm": True}}, torch.nn.BatchNorm1d(4), "snn.sync_batchnorm"),
             ({}, torch.nn.SyncBatchNorm(4), "the model's SyncBatchNorm layers"),
             ({}, convert_sync_batchnorm(torch.nn.BatchNorm1d(4)), "the model's SyncBatchNorm layers")]  # fmt: skip
    for extra, model, which in cases:
        config = load_config({**plain, **extra}, 2)
        with pytest.raises(ConfigError, match=rf"(?s)synchronised \({which}\).*stay within a group"):
            check_supported(config, "ddp", synchronised_batch_norm(config, model))
    config = load_config(plain, 2)
    check_supported(config, "ddp", synchronised_batch_norm(config, torch.nn.BatchNorm1d(4)))


def test_the_replica_environment_is_read_and_checked() -> None:
    from spikingsail.engine.replicas import ReplicaEnv

    assert ReplicaEnv.from_env({}) is None
    env = {"REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "3", "TORCHFT_LIGHTHOUSE": "http://h:1",
           "SAIL_REPLICA_SECRET": "ab" * 32}  # fmt: skip
    assert ReplicaEnv.from_env(env) == ReplicaEnv(1, 3, "http://h:1", bytes([0xAB] * 32))
    with pytest.raises(ConfigError, match="replica group 3 of 3"):
        ReplicaEnv.from_env({**env, "REPLICA_GROUP_ID": "3"})
    with pytest.raises(ConfigError, match="both integers"):
        ReplicaEnv.from_env({**env, "REPLICA_GROUP_ID": "x"})


def test_a_refused_replica_engine_leaves_nothing_running(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import threading

    import spikingsail
    from spikingsail.environments import RankInfo

    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "2")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    monkeypatch.setenv("SAIL_REPLICA_SECRET", "ab" * 32)
    threads = set(threading.enumerate())
    config = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "checkpoint": {"path": str(tmp_path / "ckpt")}}  # fmt: skip
    with pytest.raises(ConfigError, match="loss scaler that skips a step"):
        spikingsail.initialize(model=torch.nn.Linear(2, 1), config=config, rank_info=RankInfo.single())
    assert {t for t in threading.enumerate() if t.is_alive()} <= threads  # no heartbeat, no watcher
    assert not list((tmp_path / "ckpt").rglob("*.lock"))  # the checkpoint directory's lock is released
