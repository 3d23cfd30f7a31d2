"""A job that resumes by itself: --checkpoints-path DIR --resume, checkpoints every 2 steps.

    elastic_job.py OUT --checkpoints-path DIR --resume [--kill-rank R --kill-step S] [--step-sleep SECONDS]

With --kill-rank, that rank SIGKILLs itself once at optimizer step S (a marker file in OUT makes
it happen only in the first attempt), as a crashed worker would.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import spikingsail

STEPS = 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=7)
    parser.add_argument(
        "--step-sleep", type=float, default=0.0, help="seconds per step, to be signalled mid-run"
    )
    parser = spikingsail.add_config_arguments(parser)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 3))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "checkpoint": {"interval_steps": 2, "keep_last": 2},
        "sail": {"seed": 1, "progress_bar": False},
    }
    engine, _ = spikingsail.SpikingSail(args, model, config=config).run()
    start = engine.global_steps
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g))
    loader = engine.dataloader(data)
    marker = args.out / "killed-once"
    while engine.global_steps < STEPS:
        for x, y in loader:
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
            (args.out / f"progress{engine.rank}").write_text(str(engine.global_steps))
            time.sleep(args.step_sleep)
            if (
                engine.rank == args.kill_rank
                and engine.global_steps == args.kill_step
                and not marker.exists()
            ):
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            if engine.global_steps == STEPS:
                break
    digest = hashlib.sha256(
        b"".join(p.detach().numpy().tobytes() for p in engine.module.parameters())
    ).hexdigest()
    (args.out / f"rank{engine.rank}.json").write_text(json.dumps({"digest": digest, "started_at": start}))
    engine.close()


if __name__ == "__main__":
    main()
