"""CUDA's device rules on a CPU machine: the engine runs on ``meta``, a stand-in device where, as on a
GPU, a CPU tensor on the wrong side of an operation fails ("Tensor on device meta is not on the
expected device cpu"). What passes here moves every tensor it needs onto the engine's device."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import spikingsail
from spikingsail.backends import process_group
from spikingsail.checkpoint.rank_state import restore_grads
from spikingsail.data.digits import load_digits_split
from spikingsail.diagnostics import probe
from spikingsail.environments import RankInfo
from spikingsail.errors import BackendError
from spikingsail.launchers import as_torchrun
from spikingsail.precision import BF16Precision
from tests.multiprocess import run_ranks

EXAMPLES = Path(__file__).parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from train_digits import DigitsNet  # noqa: E402


@pytest.fixture
def stand_in_gpu(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """Every engine built inside puts its model on the stand-in device, as it would on cuda:LOCAL_RANK."""
    device = torch.device("meta")
    monkeypatch.setattr(process_group, "select_device", lambda rank_info: device)
    return device


def config(tmp_path: Path, **changes: object) -> str:
    # the digits example's config, without what reads values back to the host (metrics, printing)
    settings = json.loads((EXAMPLES / "configs" / "digits.json").read_text())
    settings["sail"].pop("metrics_path")
    settings["steps_per_print"] = 10**6
    settings.update(changes)
    path = tmp_path / "digits.json"
    path.write_text(json.dumps(settings))
    return str(path)


def test_the_main_jobs_step_runs_on_the_engines_device(stand_in_gpu: torch.device, tmp_path: Path) -> None:
    train_set, _ = load_digits_split()
    engine, _ = spikingsail.SpikingSail(None, DigitsNet(), config=config(tmp_path)).run()
    assert engine.device == stand_in_gpu
    loader = engine.dataloader(train_set, shuffle=True)
    for step, (images, labels) in enumerate(loader, start=1):
        # examples/train_digits.py's loop body: the labels meet the model's output in the loss
        assert images.device == labels.device == stand_in_gpu
        loss = F.cross_entropy(engine(images), labels)
        engine.backward(loss)
        engine.step()
        if step == 3:
            break
    assert engine.global_steps == 3
    engine.close()


class Pairs(Dataset[dict[str, object]]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, object]:
        return {"x": torch.full((2,), float(index)), "meta": [torch.tensor(index), "name"]}


def test_every_tensor_of_a_nested_batch_arrives_on_the_device_unless_asked_not_to(
    stand_in_gpu: torch.device, tmp_path: Path
) -> None:
    engine, _ = spikingsail.SpikingSail(None, DigitsNet(), config=config(tmp_path)).run()
    batch = next(iter(engine.dataloader(Pairs())))
    assert (
        batch["x"].device == batch["meta"][0].device == stand_in_gpu
        and list(batch["meta"][1]) == ["name"] * 8
    )
    engine.close()
    off = config(tmp_path, sail={"seed": 0, "move_inputs_to_device": False})
    engine, _ = spikingsail.SpikingSail(None, DigitsNet(), config=off).run()
    assert next(iter(engine.dataloader(Pairs())))["x"].device == torch.device("cpu")
    engine.close()


def test_partial_gradients_from_a_checkpoint_land_on_the_parameters_device(
    stand_in_gpu: torch.device,
) -> None:
    module = torch.nn.Linear(3, 2).to(stand_in_gpu)
    saved = {"weight": torch.ones(2, 3), "bias": None}  # as torch.load(map_location="cpu") gives them
    restore_grads(module, saved)
    assert module.weight.grad is not None and module.weight.grad.device == stand_in_gpu
    assert module.bias.grad is None


class FakeGPUs:
    """torch.cuda's random-state calls for a node whose GPUs each hold a stream of their own."""

    def __init__(self, count: int) -> None:
        self.streams = {index: torch.tensor([index]) for index in range(count)}

    def get_rng_state(self, device: torch.device) -> torch.Tensor:
        return self.streams[device.index].clone()

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        if device.index not in self.streams:
            raise IndexError(f"no GPU {device.index}")
        self.streams[device.index] = state.clone()


def test_a_ranks_gpu_stream_follows_the_rank_to_a_node_with_fewer_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from spikingsail.checkpoint.rank_state import capture_rng, restore_rng

    eight = FakeGPUs(8)
    monkeypatch.setattr(torch.cuda, "get_rng_state", eight.get_rng_state)
    saved = capture_rng(torch.device("cuda", 5))  # rank 5 of an 8-GPU node
    assert torch.equal(saved["cuda_device"], torch.tensor([5])) and "cuda" not in saved
    # resumed as local rank 1 of a 4-GPU node, with one GPU bound per task (the rank sees cuda:0)
    for now in (FakeGPUs(4), FakeGPUs(1)):
        monkeypatch.setattr(torch.cuda, "set_rng_state", now.set_rng_state)
        index = 1 if len(now.streams) == 4 else 0
        restore_rng(saved, torch.device("cuda", index))
        assert torch.equal(now.streams[index], torch.tensor([5]))  # its own stream, on its own device
        others = [i for i in now.streams if i != index]
        assert all(torch.equal(now.streams[i], torch.tensor([i])) for i in others)  # nobody else's


def test_an_older_checkpoints_per_index_streams_restore_the_ranks_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from spikingsail.checkpoint.rank_state import capture_rng, restore_rng

    state = capture_rng(torch.device("cpu"))
    state["cuda"] = [torch.tensor([i]) for i in range(8)]
    gpus = FakeGPUs(2)
    monkeypatch.setattr(torch.cuda, "set_rng_state", gpus.set_rng_state)
    restore_rng(state, torch.device("cuda", 1))
    assert torch.equal(gpus.streams[1], torch.tensor([1])) and torch.equal(gpus.streams[0], torch.tensor([0]))


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> list[torch.device]:
    """torch.cuda as a node with ``count`` visible GPUs shows it; returns the devices set current."""
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def rank(local_rank: int, local_world_size: int = 4) -> RankInfo:
    return RankInfo(rank=local_rank, local_rank=local_rank, world_size=local_world_size,
                    local_world_size=local_world_size, master_addr="n1", master_port=29500, source="slurm")  # fmt: skip


def test_a_task_bound_to_one_gpu_uses_it_whatever_its_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = fake_gpus(monkeypatch, 1)  # srun --gpus-per-task=1: each task sees its own GPU as device 0
    assert process_group.select_device(rank(3)) == torch.device("cuda", 0) and chosen == [
        torch.device("cuda", 0)
    ]
    chosen = fake_gpus(monkeypatch, 4)
    assert process_group.select_device(rank(3)) == torch.device("cuda", 3)
    chosen = fake_gpus(monkeypatch, 2)
    with pytest.raises(BackendError, match="local rank 3 needs GPU 3, but this node shows 2"):
        process_group.select_device(rank(3))


def test_the_plain_script_shim_points_local_rank_at_the_one_bound_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(as_torchrun, "discover_rank_info", lambda: rank(2))
    fake_gpus(monkeypatch, 1)
    assert as_torchrun.torchrun_variables()["LOCAL_RANK"] == "0"
    fake_gpus(monkeypatch, 4)
    assert as_torchrun.torchrun_variables()["LOCAL_RANK"] == "2"


def test_bf16_on_a_gpu_that_only_emulates_it_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # a V100 as torch 2.13 reports it: is_bf16_supported() says yes (emulated), capability 7.0
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100S-PCIE-32GB")
    with pytest.raises(BackendError, match="Tesla V100S-PCIE-32GB has no bfloat16 support"):
        BF16Precision(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    assert BF16Precision(torch.device("cuda", 0)).dtype == torch.bfloat16


def test_the_doctors_gpu_facts_say_bf16_only_for_hardware_support() -> None:
    def fake_torch(major: int) -> SimpleNamespace:
        props = SimpleNamespace(name=f"GPU {major}.0", total_memory=2**34, major=major, minor=0)
        cuda = SimpleNamespace(get_device_properties=lambda index: props, is_bf16_supported=lambda: True)
        return SimpleNamespace(cuda=cuda)

    assert probe._gpu(fake_torch(7), 0)["bf16"] is False  # V100, T4: emulated only
    assert probe._gpu(fake_torch(8), 0)["bf16"] is True


def test_deterministic_turns_on_deterministic_kernels_before_cuda_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # so that the test ends with it as it was
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)  # fmt: skip
    torch.backends.cudnn.benchmark = True
    try:
        engine, _ = spikingsail.SpikingSail(
            None, DigitsNet(), config=config(tmp_path, sail={"deterministic": True})
        ).run()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        engine.close()
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]


def test_a_mask_that_hides_every_gpu_of_a_gpu_node_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # --include node:4,5 on a 4-GPU node: CUDA sees nothing, and the job would train on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(process_group, "nvidia_gpus", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(
        BackendError, match=r"CUDA_VISIBLE_DEVICES=4,5 leaves no GPU visible on .*, which has 4 \(0-3\)"
    ):
        process_group.select_device(rank(0))
    for allowed in ("", "-1"):  # hidden on purpose: the CPU it is
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", allowed)
        assert process_group.select_device(rank(0)) == torch.device("cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.setattr(process_group, "nvidia_gpus", lambda: 0)  # a CPU node: nothing to hide
    assert process_group.select_device(rank(0)) == torch.device("cpu")


def _join_with(device_type: str) -> str:
    """Join the default group as a rank whose device is ``device_type`` (rank 1: a GPU node's)."""
    from spikingsail.config.parse import load_config
    from spikingsail.environments import discover_rank_info

    info = discover_rank_info()
    config = load_config({"train_micro_batch_size_per_gpu": 1}, world_size=info.world_size)
    device = torch.device(device_type, 0) if info.rank == 1 else torch.device("cpu")
    try:
        process_group.join_process_group(config.sail, config.source, info, device)
    except BackendError as err:
        return str(err)
    process_group.leave_process_group()
    return "joined"


@pytest.mark.multiprocess
def test_ranks_that_would_mix_nccl_and_gloo_are_refused_before_the_group_forms() -> None:
    results = run_ranks(_join_with, 2, "cuda")
    for message in results.values():
        assert message.startswith("the ranks disagree on the collective backend: rank 1 on ")
        assert "chose nccl (cuda:0) while rank 0 on " in message and "chose gloo (cpu)" in message
    assert run_ranks(_join_with, 2, "cpu") == {0: "joined", 1: "joined"}
