"""A small engine job for the cluster tests: trains, then records what each rank ended with.

ddp_job.py OUT_DIR [--steps N] [--until FILE] [--step-sleep S] [--die-rank R --die-step S] [--exit-rank R --exit-code C]

--until: after the N steps, go on stepping until FILE exists (the ranks agree on the step: any rank
that sees it stops them all); each step then writes its number to OUT_DIR/step{RANK}.

--exit-rank: that rank exits with status C once the job is done, the engine closed and every other
rank's process gone (the nodes share a process table), 2 s later: when the other ranks' agents
are waiting for it in torchrun's exit barrier.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import spikingsail


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--until", type=Path)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--die-step", type=int, default=3)
    parser.add_argument("--exit-rank", type=int, default=-1)
    parser.add_argument("--exit-code", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "sail": {"progress_bar": False},
    }
    engine, _ = spikingsail.initialize(model=model, config=config)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"started{engine.rank}").touch()
    g = torch.Generator().manual_seed(100 + engine.rank)
    step = 0
    while step < args.steps or (args.until is not None and not _seen(args.until)):
        if engine.rank == args.die_rank and step == args.die_step:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
        time.sleep(args.step_sleep)
        step += 1
        if args.until is not None:
            (args.out / f"step{engine.rank}").write_text(str(step))
    digest = hashlib.sha256(
        b"".join(p.detach().numpy().tobytes() for p in engine.module.parameters())
    ).hexdigest()
    record = {
        "rank": engine.rank,
        "world_size": engine.world_size,
        "host": socket.gethostname(),
        "digest": digest,
        "source": engine.rank_info.source,
        "steps": engine.global_steps,
        "pid": os.getpid(),
    }
    (args.out / f"rank{engine.rank}.json").write_text(json.dumps(record))
    print(f"rank {engine.rank} trained {engine.global_steps} steps", flush=True)
    engine.close()
    if engine.rank == args.exit_rank:
        others = [args.out / f"rank{r}.json" for r in range(engine.world_size) if r != engine.rank]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(gone(path) for path in others):
            time.sleep(0.1)
        time.sleep(2)  # an agent notices its workers' exit within its monitor interval
        sys.exit(args.exit_code)


def _seen(path: Path) -> bool:
    """Whether any rank sees ``path``."""
    flag = torch.tensor([float(path.exists())])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def gone(record: Path) -> bool:
    """The rank that wrote ``record`` has exited and its agent has reaped it."""
    if not record.exists():
        return False
    try:
        os.kill(json.loads(record.read_text())["pid"], 0)
    except ProcessLookupError:
        return True
    except (ValueError, KeyError):  # written but not yet complete
        return False
    return False


if __name__ == "__main__":
    main()
