"""Gradient communication counted, not assumed: the reductions each backend issues in every micro-step
of an accumulation window, on 2 real gloo ranks.

torch.distributed's collectives are counted by the profiler (``c10d::`` ops, whoever calls them: DDP's
reducer, FSDP2, ZeroRedundancyOptimizer, DeepSpeed); Horovod's by wrapping the all-reduce calls of its
DistributedOptimizer.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import spikingsail
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.multiprocess
ACCUMULATION = 3
REDUCTIONS = ("allreduce", "reduce_scatter")


@contextlib.contextmanager
def horovod_counter(counts: Counter[str]) -> Iterator[None]:
    import horovod.torch.optimizer as hvd_optimizer

    originals = {
        name: getattr(hvd_optimizer, name) for name in ("allreduce_async_", "grouped_allreduce_async_")
    }

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[f"horovod::{name}"] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(hvd_optimizer, name, counting(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(hvd_optimizer, name, original)


def reductions_per_micro_step(backend: str, stage: int) -> list[int]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ACCUMULATION,
        "zero_optimization": {"stage": stage},
        "sail": {"backend": backend, "progress_bar": False, "seed": 1},
    }
    engine, _ = spikingsail.initialize(
        model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), config=config
    )
    counted: list[int] = []
    for _ in range(2 * ACCUMULATION):
        horovod: Counter[str] = Counter()
        with (
            profile(activities=[ProfilerActivity.CPU]) as prof,
            horovod_counter(horovod) if backend == "horovod" else contextlib.nullcontext(),
        ):
            loss = engine(torch.randn(2, 4)).float().sum()
            engine.backward(loss)
            # the backward's reductions only: the step's own traffic (ZeRO-1's parameter
            # broadcast, DeepSpeed's overflow check) is not gradient synchronisation
        ops = Counter(e.name for e in prof.events() if e.name.startswith("c10d::"))
        counted.append(
            sum(n for op, n in ops.items() if any(r in op for r in REDUCTIONS)) + sum(horovod.values())
        )
        engine.step()
    engine.close()
    return counted


@pytest.mark.parametrize(
    ("backend", "stage"), [("ddp", 0), ("ddp", 1), ("fsdp", 3), ("deepspeed", 1), ("horovod", 0)]
)
def test_gradients_are_reduced_once_per_window_at_its_boundary(backend: str, stage: int) -> None:
    for counted in run_ranks(reductions_per_micro_step, 2, backend, stage).values():
        windows = [counted[i : i + ACCUMULATION] for i in range(0, len(counted), ACCUMULATION)]
        for window in windows:
            assert window[:-1] == [0] * (ACCUMULATION - 1), f"reductions inside the window: {counted}"
            assert window[-1] > 0, f"no reduction at the boundary: {counted}"
        assert windows[0] == windows[1]


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_2_and_3_reduce_every_micro_step_by_design(stage: int) -> None:
    # A rank keeps only its partition of the gradients, so each backward reduce-scatters into the
    # owners' partitions (DeepSpeed's design; the README says so): the same count on every micro-step.
    for counted in run_ranks(reductions_per_micro_step, 2, "deepspeed", stage).values():
        assert counted[0] > 0 and counted == [counted[0]] * len(counted), counted
