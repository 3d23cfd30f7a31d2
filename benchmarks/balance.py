"""Mixed-speed ranks: samples/s with ``sail.balance`` off and auto, against the ideal, in one run.

    python benchmarks/balance.py                    # needs root and the cgroup v1 cpu controller
    python benchmarks/balance.py --rounds 5 --steps 40 --seconds 8
    python benchmarks/balance.py --quota 25
    python benchmarks/balance.py --micro 256 --accumulation 1   # less compute per all-reduce

Two gloo ranks on this machine, one thread each; rank 1 runs in a cgroup whose CPU quota is
``--quota`` percent of one core (a period of 10 ms, so the slowdown is even, as on a slower
device). The model is compute-bound (an MLP; by default 1024-sample micro-batches per rank on
average and 4 of them per optimizer step, so the all-reduce is a small part of a step).

Each of ``--rounds`` rounds measures, one after the other:

standalone  each rank's training samples/s alone (a DataLoader over the same data, forward,
            backward, SGD step, no all-reduce), both at the same time, under the same quota, at
            equal micro-batches before and after the round's runs (the next round's "before");
            ideal = the sum of their means; and once more at the shares auto chose (a rank's
            speed per sample depends on its micro-batch); the round's ratios are to the larger ideal
off         2 ranks, equal micro-batches: every step waits for the slow rank (20 steps timed)
auto        2 ranks, ``"sail": {"balance": "auto"}``: throughput of ``--steps`` steps once it has split,
            refined and probed (``Balancer.settled``); and over the whole run from step 2, its
            measuring and probing included

A shared machine's speed drifts by more than the gap measured here (the same standalone loop can
differ by 25% between two measurements a minute apart), so the rounds interleave the runs and the
ideal, and the summary gives the median ratio over the rounds and its range. Prints each round's
table, then the summary.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.launchers.spawn import run_processes
from spikingsail.monitor.report import read_run

CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000
WINDOW = 10  # steps per phase-timing record
SETTLE_LIMIT = 200
"""auto's timed steps begin here if it has not settled by then (the table says so)."""


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )  # fmt: skip


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(4)
    return TensorDataset(torch.randn(65536, 256, generator=g), torch.randint(0, 10, (65536,), generator=g))


def join(group: str) -> int:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if rank == 1:
        (Path(group) / "cgroup.procs").write_text(str(os.getpid()))
    return rank


def standalone(group: str, seconds: float, micros: list[int]) -> float:
    """Samples/s of a plain training loop on this rank alone, at micro-batches of ``micros[rank]``:
    torch's DataLoader over the same data set, forward, backward, SGD step; no process group work
    in the loop."""
    micro = micros[join(group)]
    dist.init_process_group("gloo")
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(data(), batch_size=micro, shuffle=True, drop_last=True)
    batches = (batch for _ in iter(int, 1) for batch in loader)
    dist.barrier()
    samples, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        x, y = next(batches)
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        samples += micro
    speed = samples / (time.perf_counter() - start)
    dist.barrier()
    dist.destroy_process_group()
    return speed


def train(group: str, balance: str, steps: int, micro: int, accumulation: int) -> dict[str, Any]:
    """The job; ``steps`` steps timed: with ``off`` after two (equal shares need no measurement),
    with ``auto`` once it has settled (at most ``SETTLE_LIMIT`` steps on). Also returns auto's
    throughput from step 2 on, and, from the engine's phase timings (``sail.straggler_window``) over
    the timed steps, each rank's milliseconds per step and those of them spent in backward after its
    last gradient (the all-reduce, and the wait for the other rank)."""
    rank = join(group)
    metrics = Path(tempfile.mkdtemp(prefix="sail-balance-")) / "metrics.jsonl"
    engine, _ = spikingsail.initialize(
        model=model(),
        config={"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
                "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
                "sail": {"progress_bar": False, "balance": balance, "metrics_path": str(metrics),
                         "straggler_window": WINDOW}},
    )  # fmt: skip
    loader = engine.dataloader(data())
    batches = (batch for _ in iter(int, 1) for batch in loader)  # epoch after epoch
    balancer = engine.balancer
    first = 2
    timed_from: int | None = None
    start = whole_start = 0.0
    while timed_from is None or engine.global_steps < timed_from + steps:
        if engine.global_steps == first and not whole_start:  # once: a step is several micro-steps
            dist.barrier()
            whole_start = time.perf_counter()
        if (
            timed_from is None
            and engine.global_steps >= first
            and (balancer is None or balancer.settled or engine.global_steps >= SETTLE_LIMIT)
        ):  # every rank sees the same all-reduced measurements, so they agree on the step
            timed_from = engine.global_steps
            if timed_from > first:
                dist.barrier()
            start = time.perf_counter() if timed_from > first else whole_start
        x, y = next(batches)
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
    dist.barrier()
    end = time.perf_counter()
    split = list(balancer.split) if balancer is not None else [micro, micro]
    probed = [c["split"] for c in balancer.changes if c.get("probed")] if balancer is not None else []
    engine.close()
    per_step = 2 * micro * accumulation
    # rank 0 writes the metrics file; ``sail report``'s reader gives its straggler windows
    windows = read_run(metrics).windows if rank == 0 else []
    phases = [w["ms_per_step"] for w in windows if w["step"] - WINDOW >= timed_from]
    shutil.rmtree(metrics.parent)
    step_ms = (
        [statistics.fmean(sum(p[phase][r] for phase in p) for p in phases) for r in (0, 1)] if phases else []
    )
    comm_ms = [statistics.fmean(p["comm"][r] for p in phases) for r in (0, 1)] if phases else []
    return {
        "rank": rank,
        "samples_per_s": steps * per_step / (end - start),
        "whole_samples_per_s": (timed_from + steps - first) * per_step / (end - whole_start),
        "settled_at": timed_from,
        "probed": probed,
        "split": split,
        "step_ms": step_ms,
        "comm_ms": comm_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quota", type=int, default=40, help="rank 1's CPU quota, percent of one core")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps (auto: once settled)")
    parser.add_argument("--micro", type=int, default=1024, help="samples per rank and micro-step, on average")
    parser.add_argument("--accumulation", type=int, default=4, help="gradient_accumulation_steps")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each standalone measurement")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of standalone, off and auto runs")
    args = parser.parse_args()
    if not (CPU_CGROUPS / "cpu.cfs_quota_us").exists():
        raise SystemExit(
            f"balance.py: no cgroup v1 cpu controller at {CPU_CGROUPS} (it slows rank 1 with it)"
        )
    group = CPU_CGROUPS / f"sail-balance-bench-{os.getpid()}"
    group.mkdir()
    rounds: list[dict[str, Any]] = []
    try:
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(PERIOD_US * args.quota // 100))
        equal = [args.micro, args.micro]
        before = run_processes(standalone, 2, (str(group), args.seconds, equal))
        for _ in range(args.rounds):
            runs = {
                balance: run_processes(train, 2, (str(group), balance, args.steps, args.micro, args.accumulation))[0]
                for balance in ("off", "auto")
            }  # fmt: skip
            at_split = run_processes(standalone, 2, (str(group), args.seconds, runs["auto"]["split"]))
            after = run_processes(standalone, 2, (str(group), args.seconds, equal))
            rounds.append({"before": before, "after": after, "at_split": at_split, "runs": runs})
            before = after
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    auto_ratios, off_ratios = [], []
    for number, measured in enumerate(rounds, 1):
        auto, off = report(number, measured, args)
        auto_ratios.append(auto)
        off_ratios.append(off)
    print(f"\nover {len(rounds)} round(s), ÷ each round's ideal:")
    for name, ratios in (("balance off", off_ratios), ("balance auto", auto_ratios)):
        print(f"{name:40} median {statistics.median(ratios):.2f}  range {min(ratios):.2f}-{max(ratios):.2f}  "
              f"({', '.join(f'{r:.2f}' for r in ratios)})")  # fmt: skip


def report(number: int, measured: dict[str, Any], args: argparse.Namespace) -> tuple[float, float]:
    """Print one round's table; returns its ratios of auto and off to the ideal."""
    before, after, at_split, runs = (measured[k] for k in ("before", "after", "at_split", "runs"))
    # A throttled rank's speed drifts by a few percent over a minute: at equal micro-batches, the
    # mean of a measurement before and one after the runs. A rank's speed per sample also depends
    # on its micro-batch (bigger matrices, fixed costs per batch spread wider): the ranks alone at
    # the split auto chose give a second ideal. Ratios are to the larger of the two.
    alone = [(before[r] + after[r]) / 2 for r in (0, 1)]
    ideal = max(sum(alone), sum(at_split.values()))
    split = runs["auto"]["split"]
    rows = [
        ("standalone rank 0 (full core)", alone[0], f"{args.micro}: before {before[0]:.0f}, after {after[0]:.0f}"),
        (f"standalone rank 1 ({args.quota}% of a core)", alone[1], f"{args.micro}: before {before[1]:.0f}, after {after[1]:.0f}"),
        ("  ideal at equal micro-batches (sum)", sum(alone), None),
        ("standalone rank 0 at auto's share", at_split[0], split[0]),
        ("standalone rank 1 at auto's share", at_split[1], split[1]),
        ("  ideal at auto's split (sum)", sum(at_split.values()), None),
        ("balance off", runs["off"]["samples_per_s"], runs["off"]["split"]),
        ("balance auto, once settled", runs["auto"]["samples_per_s"],
         f"{runs['auto']['split']}, settled at step {runs['auto']['settled_at']}"
         + (" (the limit: not settled)" if runs["auto"]["settled_at"] >= SETTLE_LIMIT else "")
         + (f", probe kept {runs['auto']['probed'][-1]}" if runs["auto"]["probed"] else ", probe kept none")),
        ("balance auto, from step 2", runs["auto"]["whole_samples_per_s"], "measuring and probing included"),
    ]  # fmt: skip
    print(f"\nround {number}\n{'run':40} {'samples/s':>10} {'÷ ideal':>8}  split / measurements")
    for name, speed, detail in rows:
        print(f"{name:40} {speed:10.0f} {speed / ideal:8.2f}  {detail or ''}")
    auto = runs["auto"]
    if auto["step_ms"]:
        # the faster rank also waits for the slower one there: the smaller of the two is the all-reduce
        shares = [c / t for c, t in zip(auto["comm_ms"], auto["step_ms"], strict=True)]
        print(f"{'  auto: backward after the last gradient':40} {'':>10} {min(shares):8.2f}  of a step (rank 0 "
              f"{auto['comm_ms'][0]:.0f} of {auto['step_ms'][0]:.0f} ms, rank 1 {auto['comm_ms'][1]:.0f} of "
              f"{auto['step_ms'][1]:.0f} ms)")  # fmt: skip
    return runs["auto"]["samples_per_s"] / ideal, runs["off"]["samples_per_s"] / ideal


if __name__ == "__main__":
    main()
