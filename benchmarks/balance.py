"""Mixed-speed ranks: samples/s with ``sail.balance`` off and auto, against the ideal, in one run.

    python benchmarks/balance.py                    # needs root and the cgroup v1 cpu controller
    python benchmarks/balance.py --rounds 5 --blocks 6 --seconds 4
    python benchmarks/balance.py --quota 25
    python benchmarks/balance.py --micro 256 --accumulation 1   # less compute per all-reduce
    python benchmarks/balance.py --sweep 3          # also fixed splits around auto's: the best one

Two gloo ranks on this machine, one thread each; rank 1 runs in a cgroup whose CPU quota is
``--quota`` percent of one core (a period of 10 ms, so the slowdown is even, as on a slower
device). The model is compute-bound (an MLP; by default 1024-sample micro-batches per rank on
average and 4 of them per optimizer step, so the all-reduce is a small part of a step).

Each of ``--rounds`` rounds starts two jobs, one after the other:

off         2 ranks, equal micro-batches: every step waits for the slow rank
auto        2 ranks, ``"sail": {"balance": "auto"}``, timed once it has split, refined and probed
            (``Balancer.settled``); and over its whole run from step 2 to the end of its first
            block, its measuring and probing included

sweep       (``--sweep K``) 2 ranks, fixed splits around the one auto ended on, rank 1's share moved
            by -K..K steps of 2% of the global micro-batch, one block each, in this order and back;
            the best of them is what any choice of split reaches here, so auto's distance from it
            is what its choice costs, and the best one's distance from the ideal is what data
            parallelism costs on this machine (the all-reduce, the engine's work, the quota's periods)

Each job, from step 2 (off) or once settled (auto), runs ``--blocks`` blocks: ``--steps`` optimizer
steps timed, then, in the same two processes, at the same time, a plain training loop on each rank
alone for ``--seconds`` (its own copy of the model, torch's DataLoader over the same data, forward,
backward, SGD step; no process group work in the loop) at the job's current shares, and for auto
once more at equal ones (a rank's speed per sample depends on its micro-batch). The ideal is the sum
of the two ranks' samples/s alone, the larger of the two; a block's ratio is the job's samples/s
over the ideal measured right after it. A shared machine's speed drifts by more than the gap
measured here (the same plain loop can differ by 25% between two measurements a minute apart),
which a ratio of two measurements seconds apart, in the same processes, mostly cancels. Prints each
round's blocks, then the median ratio of each round and of all rounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
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


class Alone:
    """A plain training loop beside the job, in the same process: its own model and SGD, and a torch
    DataLoader per micro-batch size; no process group work in the loop."""

    def __init__(self) -> None:
        self.net = model()
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.01)
        self.batches: dict[int, Iterator[list[torch.Tensor]]] = {}

    def speed(self, micro: int, seconds: float) -> float:
        """Samples/s of this rank alone at micro-batches of ``micro`` (every rank at once)."""
        if micro not in self.batches:
            loader = torch.utils.data.DataLoader(data(), batch_size=micro, shuffle=True, drop_last=True)
            self.batches[micro] = (batch for _ in iter(int, 1) for batch in loader)
        batches = self.batches[micro]
        dist.barrier()
        samples, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            x, y = next(batches)
            F.cross_entropy(self.net(x), y).backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            samples += micro
        return samples / (time.perf_counter() - start)

    def ideal(self, split: list[int], seconds: float) -> float:
        """The sum of the ranks' samples/s alone, each at its share of ``split``."""
        mine = torch.zeros(len(split), dtype=torch.float64)
        mine[dist.get_rank()] = self.speed(split[dist.get_rank()], seconds)
        dist.all_reduce(mine)
        return float(mine.sum())


def train(
    group: str,
    balance: str | list[float],
    blocks: int,
    steps: int,
    micro: int,
    accumulation: int,
    seconds: float,
    splits: list[list[int]] | None = None,
) -> dict[str, Any]:
    """The job: with ``off`` from step 2 (equal shares need no measurement), with ``auto`` once it
    has settled (at most ``SETTLE_LIMIT`` steps on), ``blocks`` blocks of ``steps`` timed steps, each
    followed by the plain loops alone (``Alone``); with ``splits`` (fixed weights), one block at
    each of them instead, the split set before the block. Also returns auto's throughput from step 2 to the
    end of its first block, and, from the engine's phase timings (``sail.straggler_window``) over
    the blocks' steps, each rank's milliseconds per step and those of them spent in backward after
    its last gradient (the all-reduce, and the wait for the other rank)."""
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
    alone = Alone()
    equal = [micro, micro]
    per_step = 2 * micro * accumulation

    def until(done: Callable[[], bool]) -> None:
        while not done():
            x, y = next(batches)
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()

    first = 2
    until(lambda: engine.global_steps >= first)
    dist.barrier()
    whole_start = time.perf_counter()
    # every rank sees the same all-reduced measurements, so they agree on the step
    until(
        lambda: (
            balancer is None or not balancer.auto or balancer.settled or engine.global_steps >= SETTLE_LIMIT
        )
    )
    settled_at = engine.global_steps
    rows: list[dict[str, Any]] = []
    whole = 0.0
    clean: list[tuple[int, int]] = []  # step ranges whose phase timings the plain loops left alone
    for block in range(len(splits) if splits is not None else blocks):
        if splits is not None:
            assert balancer is not None and balancer.timer is None
            balancer.split = list(splits[block])  # a fixed split, read by the sampler at each step
            until(lambda b=engine.global_steps: engine.global_steps >= b + 1)  # type: ignore[misc]
        dist.barrier()
        begin, start = engine.global_steps, time.perf_counter()
        until(lambda b=begin: engine.global_steps >= b + steps)  # type: ignore[misc]
        dist.barrier()
        end = time.perf_counter()
        if block == 0:
            whole = (engine.global_steps - first) * per_step / (end - whole_start)
        clean.append((begin + (2 if block else 1), engine.global_steps))  # step begin+1: after the loops
        split = list(balancer.split) if balancer is not None else equal
        ideals = {"split": alone.ideal(split, seconds)}
        if split != equal:
            ideals["equal"] = alone.ideal(equal, seconds)
        if balancer is not None and balancer.timer is not None:
            balancer.timer.restart()  # the plain loops' time is not the job's compute
        rows.append({"samples_per_s": steps * per_step / (end - start), "split": split, "ideals": ideals})
    probed = [c["split"] for c in balancer.changes if c.get("probed")] if balancer is not None else []
    engine.close()
    # rank 0 writes the metrics file; ``sail report``'s reader gives its straggler windows
    windows = read_run(metrics).windows if rank == 0 else []
    phases = [
        w["ms_per_step"]
        for w in windows
        if any(a <= w["step"] - WINDOW + 1 and w["step"] <= b for a, b in clean)
    ]
    shutil.rmtree(metrics.parent)
    step_ms = (
        [statistics.fmean(sum(p[phase][r] for phase in p) for p in phases) for r in (0, 1)] if phases else []
    )
    comm_ms = [statistics.fmean(p["comm"][r] for p in phases) for r in (0, 1)] if phases else []
    return {
        "rank": rank,
        "blocks": rows,
        "whole_samples_per_s": whole,
        "settled_at": settled_at,
        "probed": probed,
        "step_ms": step_ms,
        "comm_ms": comm_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quota", type=int, default=40, help="rank 1's CPU quota, percent of one core")
    parser.add_argument(
        "--blocks", type=int, default=4, help="timed blocks per job, each followed by the ideal"
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per block")
    parser.add_argument("--micro", type=int, default=1024, help="samples per rank and micro-step, on average")
    parser.add_argument("--accumulation", type=int, default=4, help="gradient_accumulation_steps")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each plain loop alone")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of an off job and an auto job")
    parser.add_argument(
        "--sweep", type=int, default=0, metavar="K",
        help="also a job at fixed splits around auto's: rank 1's share moved by -K..K steps of 2%%",
    )  # fmt: skip
    args = parser.parse_args()
    if not (CPU_CGROUPS / "cpu.cfs_quota_us").exists():
        raise SystemExit(
            f"balance.py: no cgroup v1 cpu controller at {CPU_CGROUPS} (it slows rank 1 with it)"
        )
    group = CPU_CGROUPS / f"sail-balance-bench-{os.getpid()}"
    group.mkdir()
    rounds: list[dict[str, dict[str, Any]]] = []
    job = (args.blocks, args.steps, args.micro, args.accumulation, args.seconds)
    try:
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(PERIOD_US * args.quota // 100))
        for _ in range(args.rounds):
            runs = {
                balance: run_processes(train, 2, (str(group), balance, *job))[0]
                for balance in ("off", "auto")
            }
            if args.sweep:
                splits = around(runs["auto"]["blocks"][-1]["split"], args.sweep)
                runs["sweep"] = run_processes(
                    train, 2, (str(group), [1.0, 1.0], *job, splits + splits[::-1])
                )[0]
            rounds.append(runs)
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    medians: dict[str, list[float]] = {balance: [] for balance in rounds[0]}
    for number, runs in enumerate(rounds, 1):
        print(f"\nround {number}")
        for balance, run in runs.items():
            medians[balance].append(report(balance, run))
    print(f"\nover {len(rounds)} round(s), each round's median block ÷ its ideal:")
    for balance, ratios in medians.items():
        print(f"balance {balance:5} median {statistics.median(ratios):.2f}  range {min(ratios):.2f}-{max(ratios):.2f}  "
              f"({', '.join(f'{r:.2f}' for r in ratios)})")  # fmt: skip


def around(split: list[int], steps: int) -> list[list[int]]:
    """Splits of two ranks with rank 1's share moved by -steps..steps steps of 2% of the total."""
    total, step = sum(split), max(1, round(0.02 * sum(split)))
    shares = [split[1] + k * step for k in range(-steps, steps + 1)]
    return [[total - n, n] for n in shares if 1 <= n < total]


def report(balance: str, run: dict[str, Any]) -> float:
    """Print one job's blocks; returns the median of their ratios to the ideal (for the sweep, the
    best split's mean ratio)."""
    title = f"balance {balance}"
    if balance == "auto":
        title += f", settled at step {run['settled_at']}" + (
            " (the limit: not settled)" if run["settled_at"] >= SETTLE_LIMIT else ""
        )
        title += f", probe kept {run['probed'][-1]}" if run["probed"] else ", probe kept none"
    print(
        f"  {title}\n  {'block':>5} {'samples/s':>10} {'ideal':>8} {'÷ ideal':>8}  split; ideal at it / at equal shares"
    )
    ratios = []
    for number, row in enumerate(run["blocks"], 1):
        ideal = max(row["ideals"].values())
        ratios.append(row["samples_per_s"] / ideal)
        alone = " / ".join(f"{v:.0f}" for v in row["ideals"].values())
        print(
            f"  {number:5} {row['samples_per_s']:10.0f} {ideal:8.0f} {ratios[-1]:8.2f}  {row['split']}; {alone}"
        )
    median = statistics.median(ratios)
    if balance == "sweep":
        by_split: dict[int, list[float]] = {}
        for row, ratio in zip(run["blocks"], ratios, strict=True):
            by_split.setdefault(row["split"][1], []).append(ratio)
        means = {n: statistics.fmean(r) for n, r in by_split.items()}
        best = max(means, key=lambda n: means[n])
        print(
            "  rank 1's share: mean ÷ ideal  " + ", ".join(f"{n}: {m:.2f}" for n, m in sorted(means.items()))
        )
        print(f"  {'best':>5} {'':>10} {'':>8} {means[best]:8.2f}  (rank 1's share {best})")
        return float(means[best])
    print(f"  {'median':>5} {'':>10} {'':>8} {median:8.2f}")
    if balance == "auto":
        first = max(run["blocks"][0]["ideals"].values())
        print(f"  from step 2 to the end of block 1 (measuring and probing included): "
              f"{run['whole_samples_per_s']:.0f} samples/s, {run['whole_samples_per_s'] / first:.2f} of block 1's ideal")  # fmt: skip
    if run["step_ms"]:
        # the faster rank also waits for the slower one there: the smaller of the two is the all-reduce
        shares = [c / t for c, t in zip(run["comm_ms"], run["step_ms"], strict=True)]
        print(f"  backward after the last gradient: {min(shares):.2f} of a step (rank 0 {run['comm_ms'][0]:.0f} of "
              f"{run['step_ms'][0]:.0f} ms, rank 1 {run['comm_ms'][1]:.0f} of {run['step_ms'][1]:.0f} ms)")  # fmt: skip
    return median


if __name__ == "__main__":
    main()
