"""Checkpoint cost: write throughput against ``dd``, the stall of an async save, and kill → restart.

    python benchmarks/checkpoint_io.py                  # all three, ~1 GB state, in the current directory
    python benchmarks/checkpoint_io.py --dir /scratch --gigabytes 2 --repeats 5
    python benchmarks/checkpoint_io.py --only write     # or: async, restart

write    ``engine.save_checkpoint`` of a model + Adam state of about ``--gigabytes`` (1 and 2 gloo
         ranks; everything in the checkpoint — DCP files, manifest with SHA-256, fsync, rename),
         against ``dd if=/dev/zero bs=16M conv=fsync`` of the same number of bytes to the same
         directory, measured alternately. Ratio = checkpoint throughput / dd throughput.
async    how long ``save_checkpoint(async_save=True)`` holds up training, against a synchronous save
         of the same state, and the step time while the background write runs.
restart  ``sail launch -n 2 --max-restarts 1 --resume``: a worker SIGKILLs itself; the time from the
         kill to the first optimizer step of the restarted group (agent notices, tears down,
         restarts, the workers rejoin, load the checkpoint, take a step).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import spikingsail

HIDDEN = 4096


def model_of(gigabytes: float) -> nn.Module:
    """Linear layers whose weights + Adam's two moments add up to about ``gigabytes``."""
    per_layer = HIDDEN * HIDDEN * 4 * 3  # fp32 weight, exp_avg, exp_avg_sq
    layers = max(1, round(gigabytes * 1e9 / per_layer))
    return nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(layers)])


def build_engine(gigabytes: float) -> spikingsail.Engine:
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
              "sail": {"progress_bar": False}}  # fmt: skip
    engine, _ = spikingsail.initialize(model=model_of(gigabytes), config=config)
    train_step(engine)  # Adam's state exists after the first step
    return engine


def train_step(engine: spikingsail.Engine) -> None:
    x = torch.randn(2, HIDDEN)
    engine.backward(F.mse_loss(engine(x), x))
    engine.step()


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def dd_seconds(target: Path, nbytes: int) -> float:
    block = 16 << 20
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", f"bs={block}", f"count={-(-nbytes // block)}",
                    "conv=fsync", "status=none"], check=True)  # fmt: skip
    seconds = time.perf_counter() - start
    target.unlink()
    return seconds


def bench_write(args: argparse.Namespace, root: Path) -> None:
    engine = build_engine(args.gigabytes)
    engine.save_checkpoint(root, tag="warmup")
    ratios, rates, dd_rates = [], [], []
    nbytes = 0
    for attempt in range(args.repeats):
        start = time.perf_counter()
        path = Path(engine.save_checkpoint(root, tag=f"t{attempt}"))
        seconds = time.perf_counter() - start
        nbytes = tree_bytes(path)
        if engine.rank == 0:
            dd = dd_seconds(root / "dd.bin", nbytes)
            rates.append(nbytes / seconds / 1e6)
            dd_rates.append(nbytes / dd / 1e6)
            ratios.append(rates[-1] / dd_rates[-1])
            shutil.rmtree(path)
        if engine.world_size > 1:
            torch.distributed.barrier()
    if engine.rank == 0:
        print(f"write  {engine.world_size} rank(s), {nbytes / 1e9:.2f} GB: checkpoint "
              f"{statistics.median(rates):.0f} MB/s, dd {statistics.median(dd_rates):.0f} MB/s, "
              f"ratio {statistics.median(ratios):.2f} (median of {args.repeats}; "
              f"all: {', '.join(f'{r:.2f}' for r in ratios)})", flush=True)  # fmt: skip
    engine.close()


def bench_async(args: argparse.Namespace, root: Path) -> None:
    engine = build_engine(args.gigabytes)
    for _ in range(3):
        train_step(engine)
    plain = []
    for _ in range(5):
        start = time.perf_counter()
        train_step(engine)
        plain.append(time.perf_counter() - start)
    start = time.perf_counter()
    engine.save_checkpoint(root, tag="sync", async_save=False)
    sync_seconds = time.perf_counter() - start
    start = time.perf_counter()
    engine.save_checkpoint(root, tag="async", async_save=True)
    stall = time.perf_counter() - start
    during = []
    handle = engine.checkpointer.background_save
    while True:  # train until every rank's background write has finished (ranks agree each step)
        writing = torch.tensor([float(handle is not None and not handle.done.done())])
        if not engine.all_reduce(writing).item():
            break
        begin = time.perf_counter()
        train_step(engine)
        during.append(time.perf_counter() - begin)
    start = time.perf_counter()
    engine.wait_for_checkpoint()
    waited = time.perf_counter() - start
    if engine.rank == 0:
        print(f"async  {engine.world_size} rank(s): synchronous save {sync_seconds:.2f} s; async save blocks "
              f"{stall:.2f} s (ratio {stall / sync_seconds:.2f}), then {len(during)} steps ran during the "
              f"write at {statistics.median(during) if during else float('nan'):.3f} s/step "
              f"(alone: {statistics.median(plain):.3f} s/step), and {waited:.2f} s was left to wait",
              flush=True)  # fmt: skip
    engine.close()


RESTART_JOB = """
import json, os, signal, sys, time, torch, torch.nn.functional as F, spikingsail
out = sys.argv[1]
parser = spikingsail.add_config_arguments(__import__("argparse").ArgumentParser())
args = parser.parse_args(sys.argv[2:])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
          "checkpoint": {"interval_steps": 5}, "sail": {"progress_bar": False}}
engine, _ = spikingsail.SpikingSail(args, model, config=config).run()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
while engine.global_steps < 20:
    x = torch.randn(8, 1024)
    engine.backward(F.mse_loss(engine(x), x)); engine.step()
    if engine.rank == 0 and (restart or engine.global_steps == 12):
        with open(out, "a") as f:
            f.write(json.dumps({"restart": restart, "step": engine.global_steps, "t": time.time()}) + "\\n")
    if restart == 0 and engine.rank == 1 and engine.global_steps == 12:
        with open(out, "a") as f:
            f.write(json.dumps({"kill": time.time()}) + "\\n")
        os.kill(os.getpid(), signal.SIGKILL)
engine.close()
"""


def bench_restart(args: argparse.Namespace, root: Path) -> None:
    times = []
    for attempt in range(args.repeats):
        work = root / f"restart{attempt}"
        work.mkdir()
        (work / "job.py").write_text(RESTART_JOB)
        events = work / "events.jsonl"
        result = subprocess.run(
            [sys.executable, "-m", "spikingsail.cli.main", "launch", "-n", "2", "--max-restarts", "1",
             str(work / "job.py"), str(events), "--checkpoints-path", str(work / "ck"), "--resume"],
            capture_output=True, text=True, check=False, timeout=600,
        )  # fmt: skip
        if result.returncode != 0:
            sys.exit(f"restart benchmark job failed:\n{result.stderr[-3000:]}")
        lines = [json.loads(line) for line in events.read_text().splitlines()]
        killed = next(e["kill"] for e in lines if "kill" in e)
        first = next(e for e in lines if e.get("restart") == 1)
        times.append(first["t"] - killed)
        lost = 12 - (first["step"] - 1)
        shutil.rmtree(work)
    print(f"restart  kill -> first step after the restart: {statistics.median(times):.2f} s "
          f"(median of {args.repeats}; all: {', '.join(f'{t:.2f}' for t in times)}); "
          f"steps redone: {lost} (checkpoint every 5 steps, killed at step 12)", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="where to write (the disk under test)")
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=["write", "async", "restart"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="process counts for write/async")
    parser.add_argument("--worker", choices=["write", "async"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        root = args.dir
        {"write": bench_write, "async": bench_async}[args.worker](args, root)
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="sail-bench-") as scratch:
        for kind in ("write", "async"):
            if args.only not in (None, kind):
                continue
            for ranks in args.ranks:
                root = Path(scratch) / f"{kind}{ranks}"
                command = [sys.executable, "-m", "spikingsail.cli.main", "launch", "-n", str(ranks), __file__,
                           "--worker", kind, "--dir", str(root), "--gigabytes", str(args.gigabytes),
                           "--repeats", str(args.repeats)]  # fmt: skip
                env = {**os.environ, "SAIL_LOG_LEVEL": "WARNING"}
                subprocess.run(command, check=True, env=env)
                shutil.rmtree(root, ignore_errors=True)
        if args.only in (None, "restart"):
            bench_restart(args, Path(scratch))


if __name__ == "__main__":
    main()
