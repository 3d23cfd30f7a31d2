"""DDP with batch norms of their own on each rank (no SyncBatchNorm): the engine leaves out DDP's
buffer broadcast before every forward (one collective per micro-step) and gives every rank rank 0's
running statistics only where they are read — an eval-mode forward, a frozen batch norm, a
checkpoint. Everything observable must equal DDP's own behaviour, which a model with one more
buffer (not a batch norm's) keeps; a checkpoint holds rank 0's statistics and each rank's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.checkpoint import dcp_io
from spikingsail.checkpoint.store import CheckpointStore
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.multiprocess


# the global batch given, so that a checkpoint resumes on one process too (with 2 micro-steps per step)
CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
          "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
          "sail": {"backend": "ddp", "seed": 4, "progress_bar": False}}  # fmt: skip


def batch_norm_model(extra_buffer: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(6, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(), torch.nn.Linear(32, 3)
    )
    if extra_buffer:  # a buffer that is not a batch norm's: DDP broadcasts them all before every forward
        net.register_buffer("scale", torch.ones(1))
    return net


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g))


def observe(extra_buffer: bool, checkpoints: str | None = None) -> dict[str, Any]:
    """Train, evaluate, train with the batch norm frozen (eval mode inside a training model), train
    on and evaluate again; return what a script can see on this rank."""
    engine, _ = spikingsail.initialize(model=batch_norm_model(extra_buffer), config=CONFIG)
    norm = engine.module[1]
    batches = iter(engine.dataloader(data()))
    probe = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    seen: dict[str, Any] = {"rank_buffers": engine.backend.rank_buffers, "eval": []}

    def train(steps: int) -> None:
        for _ in range(steps):
            x, y = next(batches)
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()

    def evaluate() -> None:
        engine.eval()
        with torch.no_grad():
            seen["eval"].append(engine(probe).clone())
        engine.train()

    train(4)
    seen["own_after_training"] = norm.running_mean.clone()
    evaluate()
    norm.eval()  # frozen: its forward reads the running statistics while the rest trains
    train(3)
    norm.train()
    train(3)
    if checkpoints:
        before = {name: b.clone() for name, b in engine.module.named_buffers()}
        engine.save_checkpoint(checkpoints)
        seen["saved_from"] = before
        seen["unchanged_by_the_save"] = all(
            torch.equal(b, before[name]) for name, b in engine.module.named_buffers()
        )
    evaluate()
    seen["params"] = [p.detach().clone() for p in engine.module.parameters()]
    engine.close()
    return seen


def test_statistics_are_not_broadcast_at_every_forward_yet_every_reading_equals_ddps() -> None:
    ours, ddps = run_ranks(observe, 2, False), run_ranks(observe, 2, True)
    assert [ours[r]["rank_buffers"] for r in (0, 1)] == [True, True]
    assert [ddps[r]["rank_buffers"] for r in (0, 1)] == [False, False]
    # no broadcast before the forwards: each rank's statistics are its own batches'
    assert not torch.equal(ours[0]["own_after_training"], ours[1]["own_after_training"])
    for rank in (0, 1):
        for got, want in zip(ours[rank]["eval"], ddps[rank]["eval"], strict=True):
            assert torch.equal(got, want), f"rank {rank}: an evaluation differs from DDP's"
        # the frozen batch norm's forwards read rank 0's statistics, as under DDP
        for got, want in zip(ours[rank]["params"], ddps[rank]["params"], strict=True):
            assert torch.equal(got, want), f"rank {rank}: training differs from DDP's"
    for got, want in zip(ours[0]["eval"], ours[1]["eval"], strict=True):
        assert torch.equal(got, want)


def evaluate_after_resume(checkpoints: str) -> dict[str, torch.Tensor]:
    """Resume, and evaluate before any training forward."""
    engine, _ = spikingsail.initialize(
        model=batch_norm_model(False), config=CONFIG, checkpoints_path=checkpoints, resume=True
    )
    own = engine.module[1].running_mean.clone()
    engine.eval()
    with torch.no_grad():
        out = engine(torch.randn(5, 6, generator=torch.Generator().manual_seed(2)))
    engine.close()
    return {"own_after_resume": own, "eval": out}


def test_a_checkpoint_holds_rank_zeros_statistics_and_each_ranks_own(tmp_path: Path) -> None:
    seen = run_ranks(observe, 2, False, str(tmp_path / "ck"))
    assert seen[0]["unchanged_by_the_save"] and seen[1]["unchanged_by_the_save"]
    own = [seen[r]["saved_from"]["1.running_mean"] for r in (0, 1)]
    assert not torch.equal(own[0], own[1])
    store = CheckpointStore(tmp_path / "ck")
    path = store.root / str(store.latest())
    files = store.metadata(str(store.latest()))["files"]
    for rank in (0, 1):  # sealed in the manifest like every other file
        assert f"rank_buffers/rank{rank}.pt" in files
        kept = dcp_io.load_weights_only(path / "rank_buffers" / f"rank{rank}.pt")
        assert torch.equal(kept["1.running_mean"], own[rank])
    model = batch_norm_model(False)
    dcp_io.load(model, None, path / "state", None)
    assert torch.equal(model[1].running_mean, own[0]), "the model state holds rank 0's statistics"

    # a resume gives each rank its own back, and an evaluation straight after it reads rank 0's
    resumed = run_ranks(evaluate_after_resume, 2, str(tmp_path / "ck"))
    for rank in (0, 1):
        assert torch.equal(resumed[rank]["own_after_resume"], own[rank])
    model.eval()
    with torch.no_grad():
        want = model(torch.randn(5, 6, generator=torch.Generator().manual_seed(2)))
    assert torch.equal(resumed[0]["eval"], want) and torch.equal(resumed[1]["eval"], want)
    # on another world size every rank starts from rank 0's
    (alone,) = run_ranks(evaluate_after_resume, 1, str(tmp_path / "ck")).values()
    assert torch.equal(alone["own_after_resume"], own[0]) and torch.equal(alone["eval"], want)
