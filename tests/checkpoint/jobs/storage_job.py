"""A job whose checkpoint directory fails under it: saves every 2 steps, keep_last 2.

    storage_job.py OUT --checkpoints-path DIR --resume [--backend ddp|fsdp|deepspeed] [--async]
        [--on-error stop|continue] [--fill-at S [--free-at T]] [--fault remount-ro|delete --fault-at S]

--fill-at S: after step S-1, rank 0 fills the checkpoint directory's filesystem with a file beside
it (``DIR/../filler``) until half a checkpoint is free, so that the save at step S runs out of space
mid-write; --free-at T removes it after step T-1, once a save still writing in the background has
ended; --signal-at S preempts (SIGTERM) before step S. --fault remount-ro remounts the filesystem
read-only after step S-1; --fault delete deletes DIR. Each rank writes OUT/rankR.json with a digest of its
parameters (its shard, under FSDP) and the step it started at; OUT/progressR holds the last step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.checkpoint.store import CheckpointStore

STEPS = 8
WIDTH = 384  # ~0.6 MB of parameters: ~1.8 MB per checkpoint with Adam's two moments


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--backend", default="ddp")
    parser.add_argument("--async", dest="background", action="store_true")
    parser.add_argument("--on-error", default=None)
    parser.add_argument("--fill-at", type=int, default=-1)
    parser.add_argument("--free-at", type=int, default=-1)
    parser.add_argument("--fault", choices=["remount-ro", "delete"], default=None)
    parser.add_argument("--fault-at", type=int, default=-1)
    parser.add_argument("--signal-at", type=int, default=-1, help="SIGTERM (a preemption) before this step")
    args = spikingsail.add_config_arguments(parser).parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.ReLU(), torch.nn.Linear(WIDTH, 3))  # fmt: skip
    checkpoint: dict[str, object] = {"interval_steps": 2, "keep_last": 2, "async_save": args.background}
    if args.on_error:
        checkpoint["on_error"] = args.on_error
    # the script's own optimizer: DeepSpeed resumes it exactly (its own FusedAdam on the CPU it may not)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "checkpoint": checkpoint,
        "sail": {"seed": 1, "progress_bar": False, "backend": args.backend,
                 "metrics_path": str(args.out / "metrics.jsonl")},
    }  # fmt: skip
    if args.backend == "deepspeed":
        config["zero_optimization"] = {"stage": 2}  # each rank writes its own optimizer partition
    engine, _ = spikingsail.SpikingSail(args, model, optimizer, config=config).run()
    start = engine.global_steps
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    loader = engine.dataloader(data)
    root = Path(args.checkpoints_path)
    while engine.global_steps < STEPS:
        for x, y in loader:
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
            (args.out / f"progress{engine.rank}").write_text(str(engine.global_steps))
            if engine.rank == 0:
                before_step(engine, args, root)
            if engine.global_steps == STEPS:
                break
    local = [getattr(p, "to_local", lambda p=p: p)() for p in engine.module.parameters()]
    digest = hashlib.sha256(b"".join(t.detach().float().numpy().tobytes() for t in local)).hexdigest()
    (args.out / f"rank{engine.rank}.json").write_text(json.dumps({"digest": digest, "started_at": start}))
    engine.close()


def before_step(engine: spikingsail.Engine, args: argparse.Namespace, root: Path) -> None:
    """Rank 0's faults, made before the next step (whose save the other ranks reach only after its
    all-reduce)."""
    step = engine.global_steps + 1
    filler = root.parent / "filler"
    if step == args.fill_at:
        engine.wait_for_checkpoint()  # the previous (background) save is in, and its size known
        store = CheckpointStore(root)
        size = store.size(str(store.latest())) or 0
        stat = shutil.disk_usage(root)
        with filler.open("wb") as handle:
            handle.write(b"\0" * max(0, stat.free - size // 2))
    if step == args.free_at:
        # not while the save at --fill-at may still be writing in the background: it would find room
        engine.wait_for_checkpoint()
        filler.unlink()
    if step == args.fault_at and args.fault == "remount-ro":
        subprocess.run(["mount", "-o", "remount,ro", str(root.parent)], check=True)
    if step == args.fault_at and args.fault == "delete":
        shutil.rmtree(root)
    if step == args.signal_at:
        os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    main()
