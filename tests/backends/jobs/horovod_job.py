"""Training runs for the Horovod tests, several per launch (starting ranks costs seconds).

    horovod_job.py OUT PLAN.json       (under horovodrun; or ``run_plan(plan)`` from run_ranks)

A plan is a list of runs, done in order by every rank, each with a fresh engine:

    {"tag": "straight", "backend": "horovod", "horovod": {...}, "clip": true, "precision": "fp16",
     "checkpoints": DIR, "stop_at": MICRO_STEP, "save_at": MICRO_STEP, "resume": false,
     "expect_error": false, "own_group": false, "batch_norm": false}

``own_group`` (for ddp runs under torchrun's agent): the job creates the default process group itself,
with keys of its own in the agent's store. A process that joins the group a second time through
the engine would find the first group's keys under the same names there and could hang.

Each rank returns (and under horovodrun writes to ``OUT/rank{R}.pt``) {tag: result}. A result holds
the final parameters, the steps taken and skipped, the window losses, the gradients the optimizer
stepped with and a few environment variables; a run with ``expect_error`` holds the error instead.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import PrefixStore, TCPStore
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.errors import SailError

MICRO_STEPS = 12
ENV_SHOWN = ("MASTER_ADDR", "MASTER_PORT", "SAIL_PROBE", "AWS_SECRET_ACCESS_KEY")


def model(batch_norm: bool = False) -> torch.nn.Module:
    """``batch_norm``: with a batch norm whose running statistics each rank keeps for itself."""
    torch.manual_seed(0)
    norm = [torch.nn.BatchNorm1d(32)] if batch_norm else []
    return torch.nn.Sequential(torch.nn.Linear(6, 32), *norm, torch.nn.Tanh(), torch.nn.Linear(32, 3))


def config(run: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "sail": {"backend": run["backend"], "seed": 4, "progress_bar": False},
    }
    if run.get("clip", True):
        cfg["gradient_clipping"] = 0.5
    if run.get("precision") == "fp16":
        # 2**20 overflows at first: the first steps are skipped until the scale has come down
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 20, "hysteresis": 1}
    elif run.get("precision") == "bf16":
        cfg["bf16"] = {"enabled": True}
    if "horovod" in run:
        cfg["horovod"] = run["horovod"]
    return cfg


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))


def train(run: dict[str, Any]) -> dict[str, Any] | None:
    engine, optimizer = spikingsail.initialize(
        model=model(run.get("batch_norm", False)), config=config(run), checkpoints_path=run.get("checkpoints"),
        resume=run.get("resume", False),
    )  # fmt: skip
    stepped: list[dict[str, torch.Tensor]] = []
    start = engine.global_steps - engine.skipped_steps

    def record(opt: torch.optim.Optimizer, *_: Any) -> None:
        # torch runs an optimizer's step hooks twice on Horovod's optimizer (its step() calls the
        # wrapped class's step(), and both are hooked): keep the first call of each step.
        if len(stepped) == engine.global_steps - engine.skipped_steps - start:
            names = {id(p): n for n, p in engine.module.named_parameters()}
            stepped.append({names[id(p)]: p.grad.clone() for g in opt.param_groups for p in g["params"]})

    optimizer.register_step_pre_hook(record)
    losses: list[float] = []
    window = 0.0
    loader = engine.dataloader(data())
    stop_at = run.get("stop_at")
    while engine.micro_steps < MICRO_STEPS:
        for x, y in loader:
            loss = F.cross_entropy(engine(x).float(), y)
            window += loss.item() / engine.gradient_accumulation_steps()
            engine.backward(loss)
            engine.step()
            if engine.micro_steps % engine.gradient_accumulation_steps() == 0:
                losses.append(window)
                window = 0.0
            if engine.micro_steps == stop_at:
                engine.save_checkpoint(run["checkpoints"])
                engine.close()
                return None
            if engine.micro_steps == run.get("save_at"):
                engine.save_checkpoint(run["checkpoints"])  # and go on
            if engine.micro_steps == MICRO_STEPS:
                break
    result = {
        "params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
        "steps": engine.global_steps,
        "skipped": engine.skipped_steps,
        "losses": losses,
        "stepped_grads": stepped,
        "rank_source": engine.rank_info.source,
        "env": {k: os.environ.get(k) for k in ENV_SHOWN},
    }
    engine.close()
    if run["backend"] == "horovod":
        result["horovod_up_after_close"] = importlib.import_module("horovod.torch").is_initialized()
    return result


@contextlib.contextmanager
def own_group(tag: str) -> Iterator[None]:
    info = spikingsail.discover_rank_info()
    assert info.use_env_store and info.master_addr and info.master_port
    store = TCPStore(info.master_addr, info.master_port, world_size=info.world_size, is_master=False,
                     timeout=datetime.timedelta(minutes=2))  # fmt: skip
    dist.init_process_group("gloo", store=PrefixStore(f"job/{tag}", store), rank=info.rank,
                            world_size=info.world_size)  # fmt: skip
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_plan(plan: list[dict[str, Any]]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for run in plan:
        try:
            with own_group(run["tag"]) if run.get("own_group") else contextlib.nullcontext():
                results[run["tag"]] = train(run)
        except SailError as err:
            if not run.get("expect_error"):
                raise
            results[run["tag"]] = {"error": type(err).__name__, "message": str(err)}
    return results


def main() -> None:
    out, plan = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    results = run_plan(plan)
    torch.save(results, out / f"rank{spikingsail.discover_rank_info().rank}.pt")


if __name__ == "__main__":
    main()
