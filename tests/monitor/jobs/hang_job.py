"""A job that hangs on purpose, for the hang-watch tests.

hang_job.py LOG_DIR --fault stop|deadlock|none [--rank R] [--step S] [--timeout SECONDS] [--steps N]

Rank R, at optimizer step S, either stops itself with a real SIGSTOP or deadlocks in Python (a lock
it already holds); the other ranks go on into the next step's gradient sync and wait there. Every
rank writes LOG_DIR/pid{RANK} when it starts. ``--fault none`` trains to the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import spikingsail


def deadlock() -> None:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # never returns


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("log_dir", type=Path)
    parser.add_argument("--fault", choices=["stop", "deadlock", "none"], default="stop")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "sail": {"progress_bar": False, "hang_timeout_seconds": args.timeout, "log_dir": str(args.log_dir)},
    }
    engine, _ = spikingsail.initialize(model=model, config=config)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    (args.log_dir / f"pid{engine.rank}").write_text(str(os.getpid()))
    g = torch.Generator().manual_seed(100 + engine.rank)
    for step in range(args.steps):
        if engine.rank == args.rank and step == args.step:
            if args.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif args.fault == "deadlock":
                deadlock()
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
        time.sleep(0.01)
    engine.close()


if __name__ == "__main__":
    main()
