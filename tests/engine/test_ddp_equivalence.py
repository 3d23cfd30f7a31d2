"""Data parallelism must not change the mathematics: N ranks × micro batch b == 1 process × N·b."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.environments import RankInfo
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.multiprocess

SINGLE = RankInfo.single()
STEPS = 6


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 10, generator=g)
    y = torch.randint(0, 3, (256,), generator=g)
    return TensorDataset(x, y)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def config(micro: int, accumulation: int, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}},
        "gradient_clipping": 0.5,
        "sail": {"progress_bar": False},
        **extra,
    }


def train(cfg: dict[str, Any], rank_info: RankInfo | None = None) -> dict[str, torch.Tensor]:
    engine, _ = spikingsail.initialize(model=model(), config=cfg, rank_info=rank_info)
    loader = engine.dataloader(dataset(), shuffle=True, seed=3)
    batches = iter(loader)
    while engine.global_steps < STEPS:
        x, y = next(batches)
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.close()
    return state


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for key, value in a.items():
        # Only the summation order differs (all-reduce vs one batch): float32 round-off, no more.
        torch.testing.assert_close(value, b[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize(("micro", "accumulation"), [(4, 1), (4, 2)])
def test_two_ranks_match_one_process_with_the_global_batch(micro: int, accumulation: int) -> None:
    results = run_ranks(train, 2, config(micro, accumulation))
    reference = train(config(micro * accumulation * 2, 1), SINGLE)
    assert_same(results[0], results[1])
    assert_same(results[0], reference)


def test_the_comparison_can_fail() -> None:
    """Without synchronised gradients the ranks diverge: the equivalence above is not vacuous."""
    single = train(config(8, 1), SINGLE)
    halves = train(config(4, 1), SINGLE)
    with pytest.raises(AssertionError):
        assert_same(single, halves)


def count_allreduces(accumulation: int, micro_steps: int) -> list[int]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    engine, _ = spikingsail.initialize(model=model(), config=config(4, accumulation))
    calls = [0]

    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        calls[0] += 1
        return allreduce_hook(state, bucket)

    engine.wrapped_module.register_comm_hook(None, counting_hook)
    after_each: list[int] = []
    for x, y in engine.dataloader(dataset()):
        if len(after_each) == micro_steps:
            break
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
        after_each.append(calls[0])
    engine.close()
    return after_each


def test_no_allreduce_on_micro_steps_that_are_not_a_boundary() -> None:
    counts = run_ranks(count_allreduces, 2, 3, 6)[0]
    per_boundary = counts[2]
    assert per_boundary >= 1
    assert counts == [0, 0, per_boundary, per_boundary, per_boundary, 2 * per_boundary]


def rank_of_each_process() -> tuple[int, int, int, str]:
    engine, _ = spikingsail.initialize(model=model(), config=config(4, 1))
    info = (engine.rank, engine.local_rank, engine.world_size, torch.distributed.get_backend())
    engine.close()
    return info


def test_ranks_come_from_torchrun_and_use_gloo_on_cpu() -> None:
    results = run_ranks(rank_of_each_process, 2)
    assert results == {0: (0, 0, 2, "gloo"), 1: (1, 1, 2, "gloo")}
