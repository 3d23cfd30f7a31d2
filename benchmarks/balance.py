"""Mixed-speed ranks: samples/s with ``sail.balance`` off and auto, against the ideal, in one run.

    python benchmarks/balance.py                    # needs root and the cgroup v1 cpu controller
    python benchmarks/balance.py --quota 25 --steps 80
    python benchmarks/balance.py --micro 256 --accumulation 1   # less compute per all-reduce

Two gloo ranks on this machine, one thread each; rank 1 runs in a cgroup whose CPU quota is
``--quota`` percent of one core (a period of 10 ms, so the slowdown is even, as on a slower
device). The model is compute-bound (an MLP; by default 1024-sample micro-batches per rank on
average and 4 of them per optimizer step, so the all-reduce is a small part of a step).

standalone  each rank's training samples/s alone (a DataLoader over the same data, forward,
            backward, SGD step, no all-reduce), both at the same time, under the same quota,
            measured before and after the two runs; ideal = the sum of their means; and once
            more at the shares auto chose (a rank's speed per sample depends on its
            micro-batch); ratios are to the larger ideal
off         2 ranks, equal micro-batches: every step waits for the slow rank
auto        2 ranks, ``"sail": {"balance": "auto"}``: throughput of the steps after its split and refinement

Prints a table with each row's samples/s and its ratio to the ideal.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.engine.balance import MEASURE_STEPS, REFINE_WINDOWS, WARMUP_STEPS
from spikingsail.launchers.spawn import run_processes

CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000


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
    rank = join(group)
    engine, _ = spikingsail.initialize(
        model=model(),
        config={"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
                "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
                "sail": {"progress_bar": False, "balance": balance}},
    )  # fmt: skip
    loader = engine.dataloader(data())
    batches = (batch for _ in iter(int, 1) for batch in loader)  # epoch after epoch
    # auto has split (after 1 + 8 steps) and refined (within 2 more windows of 8) by then
    timed_from, start = WARMUP_STEPS + MEASURE_STEPS * (1 + REFINE_WINDOWS), 0.0
    while engine.global_steps < steps:
        if engine.global_steps == timed_from:
            dist.barrier()
            start = time.perf_counter()
        x, y = next(batches)
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
    dist.barrier()
    elapsed = time.perf_counter() - start
    split = list(engine.balancer.split) if engine.balancer is not None else [micro, micro]
    engine.close()
    samples = (steps - timed_from) * 2 * micro * accumulation
    return {"rank": rank, "samples_per_s": samples / elapsed, "split": split}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quota", type=int, default=40, help="rank 1's CPU quota, percent of one core")
    parser.add_argument(
        "--steps", type=int, default=45, help="optimizer steps; those after auto's refinement (25) are timed"
    )
    parser.add_argument("--micro", type=int, default=1024, help="samples per rank and micro-step, on average")
    parser.add_argument("--accumulation", type=int, default=4, help="gradient_accumulation_steps")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each standalone measurement")
    args = parser.parse_args()
    if not (CPU_CGROUPS / "cpu.cfs_quota_us").exists():
        raise SystemExit(
            f"balance.py: no cgroup v1 cpu controller at {CPU_CGROUPS} (it slows rank 1 with it)"
        )
    group = CPU_CGROUPS / f"sail-balance-bench-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(PERIOD_US * args.quota // 100))
        equal = [args.micro, args.micro]
        before = run_processes(standalone, 2, (str(group), args.seconds, equal))
        runs = {}
        for balance in ("off", "auto"):
            runs[balance] = run_processes(
                train, 2, (str(group), balance, args.steps, args.micro, args.accumulation)
            )[0]
        after = run_processes(standalone, 2, (str(group), args.seconds, equal))
        at_split = run_processes(standalone, 2, (str(group), args.seconds, runs["auto"]["split"]))
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
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
        *((f"balance {name}", run["samples_per_s"], run["split"]) for name, run in runs.items()),
    ]  # fmt: skip
    print(f"\n{'run':40} {'samples/s':>10} {'÷ ideal':>8}  split / measurements")
    for name, speed, detail in rows:
        print(f"{name:40} {speed:10.0f} {speed / ideal:8.2f}  {detail or ''}")


if __name__ == "__main__":
    main()
