"""SNNs under data parallelism on real gloo ranks: multi-step SyncBatchNorm, parity with one process, resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from spikingjelly.activation_based import layer
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.environments import RankInfo
from spikingsail.snn import MultiStepSyncBatchNorm, convert_sync_batchnorm, firing_rate
from tests.multiprocess import run_ranks, train_micro_steps
from tests.snn.models import spiking_cnn

pytestmark = pytest.mark.multiprocess

T, N, C = 3, 8, 4


def bn_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(T, N, C, 5, 5, generator=g) * 2 + 1, torch.randn(T, N, C, 5, 5, generator=g)


def batch_norm_run(world: int) -> dict[str, torch.Tensor]:
    """Multi-step batch norm on this rank's N / world samples (all of them in one process)."""
    x_full, upstream = bn_inputs()
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    part = slice(rank * N // world, (rank + 1) * N // world)
    x = x_full[:, part].clone().requires_grad_()
    bn = layer.BatchNorm2d(C, step_mode="m")
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 2, C))
        bn.bias.copy_(torch.linspace(-1, 1, C))
    if world > 1:
        bn = convert_sync_batchnorm(bn)
        assert isinstance(bn, MultiStepSyncBatchNorm) and bn.step_mode == "m"
    out = bn(x)
    (out * upstream[:, part]).sum().backward()
    assert bn.weight.grad is not None and x.grad is not None
    weight_grad = bn.weight.grad.clone()
    if world > 1:  # what DDP would add up
        dist.all_reduce(weight_grad)
        dist.destroy_process_group()
    return {"out": out.detach(), "x_grad": x.grad, "weight_grad": weight_grad,
            "running_mean": bn.running_mean.clone(), "running_var": bn.running_var.clone()}  # fmt: skip


def test_multi_step_sync_batchnorm_matches_batchnorm_over_the_whole_batch() -> None:
    whole = batch_norm_run(1)
    ranks = run_ranks(batch_norm_run, 2, 2)
    for key in ("out", "x_grad"):
        torch.testing.assert_close(torch.cat([ranks[0][key], ranks[1][key]], dim=1), whole[key])
    for key in ("weight_grad", "running_mean", "running_var"):
        torch.testing.assert_close(ranks[0][key], whole[key])
        torch.testing.assert_close(ranks[1][key], whole[key])


def snn_config(micro: int, accumulation: int, backend: str = "ddp", balance: Any = "off") -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "snn": {"step_mode": "m", "time_steps": 4, "sync_batchnorm": True},
        "sail": {"seed": 3, "progress_bar": False, "backend": backend, "balance": balance},
    }


def digits() -> TensorDataset:
    g = torch.Generator().manual_seed(9)
    return TensorDataset(torch.rand(48, 1, 4, 4, generator=g) * 2, torch.randint(0, 3, (48,), generator=g))


def snn_train(
    single: bool, micro: int, accumulation: int, checkpoints: str | None = None,
    stop_at: int | None = None, resume: bool = False, micro_steps: int = 12, backend: str = "ddp",
    balance: Any = "off",
) -> dict[str, Any] | None:  # fmt: skip
    engine, _ = spikingsail.initialize(
        model=spiking_cnn(), config=snn_config(micro, accumulation, backend, balance),
        rank_info=RankInfo.single() if single else None, checkpoints_path=checkpoints, resume=resume,
    )  # fmt: skip
    loader = engine.dataloader(digits())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        rate = firing_rate(engine(engine.encode(x)))
        engine.backward(F.mse_loss(rate, F.one_hot(y, 3).float()))
        engine.step()

    if not train_micro_steps(engine, loader, micro_steps, step, stop_at=stop_at, checkpoints=checkpoints):
        return None
    full = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True))
    state = {k: v.clone() for k, v in full.items()}
    engine.close()
    return state


@pytest.mark.parametrize(("accumulation", "backend"), [(1, "ddp"), (2, "ddp"), (2, "fsdp")])
def test_two_ranks_of_b_equal_one_process_of_2b(accumulation: int, backend: str) -> None:
    reference = snn_train(True, 8, accumulation)
    ranks = run_ranks(snn_train, 2, False, 4, accumulation, None, None, False, 12, backend)
    assert reference is not None
    assert any("running_mean" in key for key in reference)  # batch norm took part
    for rank in (0, 1):
        for key, value in reference.items():
            torch.testing.assert_close(ranks[rank][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize(("accumulation", "backend"), [(1, "ddp"), (2, "fsdp")])
def test_unequal_micro_batches_equal_one_process_with_synchronised_batch_norm(
    accumulation: int, backend: str
) -> None:
    """Ranks taking 6 and 2 of every 8 samples: batch-norm statistics weighted by count, each
    rank's loss by its share: still one process's training."""
    reference = snn_train(True, 8, accumulation)
    ranks = run_ranks(snn_train, 2, False, 4, accumulation, None, None, False, 12, backend, [3, 1])
    assert reference is not None
    for rank in (0, 1):
        for key, value in reference.items():
            torch.testing.assert_close(ranks[rank][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_snn_resume_is_bit_exact(tmp_path: Path) -> None:
    straight = run_ranks(snn_train, 2, False, 4, 2)
    assert run_ranks(snn_train, 2, False, 4, 2, str(tmp_path), 7) == {0: None, 1: None}  # mid-window
    resumed = run_ranks(snn_train, 2, False, 4, 2, str(tmp_path), None, True)
    for rank in (0, 1):
        for key, value in straight[rank].items():
            assert torch.equal(resumed[rank][key], value), key
