"""The data-parallel view (``Backend.data_parallel``): a tensor-parallel backend added in one file
and one registry line (``tensor_parallel.py``) trains through the engine unchanged, its batch sizes
and its loader counting data-parallel replicas, not processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import spikingsail
from tests.backends.tensor_parallel import REGISTRY_LINE
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.multiprocess
STEPS = 6
MICRO = 8


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(STEPS * MICRO, 6, generator=g), torch.randint(0, 3, (STEPS * MICRO,), generator=g)
    )


def train_tensor_parallel() -> dict[str, Any]:
    from spikingsail import backends

    backends._REGISTRY.setdefault(*REGISTRY_LINE)
    config = {
        "train_batch_size": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "sail": {"backend": "tensor-parallel", "progress_bar": False},
    }
    engine, _ = spikingsail.initialize(model=model(), config=config)
    seen = []
    for x, y in engine.dataloader(data(), shuffle=False):
        seen.append(x.clone())
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
    full = {name: p.full_tensor().detach().clone() for name, p in engine.module.named_parameters()}
    result = {"weights": full, "seen": torch.cat(seen), "batch": (engine.config.train_micro_batch_size_per_gpu,
              engine.config.world_size, engine.global_steps)}  # fmt: skip
    engine.close()
    return result


def test_a_tensor_parallel_backend_trains_as_one_process_does() -> None:
    results = run_ranks(train_tensor_parallel, 2)
    reference = model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    dataset = data()
    for step in range(STEPS):
        x, y = dataset[step * MICRO : (step + 1) * MICRO]
        optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        optimizer.step()
    for rank in (0, 1):
        # one replica: the whole micro-batch on both processes, the batch sizes counting one replica
        assert results[rank]["batch"] == (MICRO, 1, STEPS)
        assert torch.equal(results[rank]["seen"], dataset.tensors[0])
        for name, expected in reference.named_parameters():
            # the row-split layer sums its slices' products over processes: not bit-exact
            torch.testing.assert_close(
                results[rank]["weights"][name], expected.detach(), rtol=1e-5, atol=1e-6
            )
