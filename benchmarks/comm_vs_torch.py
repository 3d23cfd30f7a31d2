"""All-reduce time of `sail bench comm` against a hand-written torch.distributed loop, and memcpy.

    python benchmarks/comm_vs_torch.py                      # all-reduce 1M..64M, 5 rounds
    python benchmarks/comm_vs_torch.py --rounds 9 --iters 40 -b 4M -e 256M

Both sides all-reduce float32 tensors on 2 gloo processes on this machine, started by torchrun's
agent: `sail bench comm -n 2 --ops all_reduce` through `sail launch`, and this file's plain loop
(``dist.all_reduce`` on a zero tensor, nothing else) through ``python -m torch.distributed.run
--standalone --nproc-per-node 2``. Same sizes, warm-up and iterations, and the same time: each
rank's wall time for the timed loop divided by the iterations, averaged over the ranks. The runs
alternate (sail then plain, plain then sail, ...) so that machine noise hits both alike; per size
the median over the rounds is kept.

memcpy bandwidth: bytes per second of ``numpy.copyto`` of a 256 MiB array in this process (one
thread, as one gloo process), the median of a few copies measured before every round. Prints per
size both times, their ratio (sail / plain), sail's busbw and busbw / memcpy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from spikingsail.diagnostics.comm_bench import bandwidths, parse_size, size_sweep

WORLD = 2
MEMCPY_BYTES = 256 * 2**20


def plain_worker(sizes: list[int], iters: int, warmup: int, output: Path) -> None:
    """One rank of the hand-written loop: time ``iters`` all-reduces per size, mean over ranks."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    times: dict[int, float] = {}
    for size in sizes:
        tensor = torch.zeros(size // 4, dtype=torch.float32)
        for _ in range(warmup):
            dist.all_reduce(tensor)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(tensor)
        total = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
        dist.all_reduce(total)
        times[size] = float(total) / world
    if rank == 0:
        output.write_text(json.dumps({str(s): t for s, t in times.items()}))
    dist.destroy_process_group()


def run_plain(args: argparse.Namespace, sizes: list[int], workdir: Path) -> dict[int, float]:
    output = workdir / "plain.json"
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
        __file__, "--plain-worker", str(output), "-b", args.min_bytes, "-e", args.max_bytes,
        "--iters", str(args.iters), "--warmup", str(args.warmup),
    ]  # fmt: skip
    subprocess.run(argv, check=True, capture_output=True, text=True)
    return {int(s): t for s, t in json.loads(output.read_text()).items()}


def run_sail(args: argparse.Namespace, workdir: Path) -> dict[int, float]:
    prefix = workdir / "sail"
    argv = [
        sys.executable, "-m", "spikingsail.cli.main", "bench", "comm", "-n", str(WORLD),
        "--ops", "all_reduce", "-b", args.min_bytes, "-e", args.max_bytes, "--iters", str(args.iters),
        "--warmup", str(args.warmup), "--dist-backend", "gloo", "--output", str(prefix),
    ]  # fmt: skip
    subprocess.run(argv, check=True, capture_output=True, text=True)
    rows = json.loads(prefix.with_suffix(".json").read_text())["results"]["all_reduce"]
    return {row["size_bytes"]: row["time_us"] / 1e6 for row in rows}


def memcpy_bandwidth(repeats: int = 5) -> float:
    src = np.ones(MEMCPY_BYTES // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch every page before timing
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        seconds.append(time.perf_counter() - start)
    return MEMCPY_BYTES / statistics.median(seconds)


def report(
    sizes: list[int], sail: list[dict[int, float]], plain: list[dict[int, float]], memcpy: float
) -> None:
    print(f"memcpy (numpy.copyto of {MEMCPY_BYTES >> 20} MiB, one thread): {memcpy / 1e9:.2f} GB/s")
    print(
        f"\n{'size':>10}{'sail (us)':>12}{'plain (us)':>12}{'sail/plain':>12}{'busbw GB/s':>12}{'busbw/memcpy':>14}"
    )
    for size in sizes:
        sail_s = statistics.median(run[size] for run in sail)
        plain_s = statistics.median(run[size] for run in plain)
        _, busbw = bandwidths("all_reduce", size, sail_s, WORLD)
        print(
            f"{size >> 20:>9}M{sail_s * 1e6:>12.0f}{plain_s * 1e6:>12.0f}{sail_s / plain_s:>12.3f}"
            f"{busbw:>12.3f}{busbw * 1e9 / memcpy:>14.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-b", "--min-bytes", default="1M", help="smallest all-reduce (default 1M)")
    parser.add_argument("-e", "--max-bytes", default="64M", help="largest all-reduce (default 64M)")
    parser.add_argument("--iters", type=int, default=20, help="timed all-reduces per size and run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed all-reduces per size before them")
    parser.add_argument("--rounds", type=int, default=5, help="alternating sail/plain run pairs (default 5)")
    parser.add_argument("--plain-worker", type=Path, help=argparse.SUPPRESS)  # set for the plain loop's ranks
    args = parser.parse_args()
    sizes = size_sweep(parse_size(args.min_bytes, "-b"), parse_size(args.max_bytes, "-e"), 2)
    if args.plain_worker:
        plain_worker(sizes, args.iters, args.warmup, args.plain_worker)
        return
    sail: list[dict[int, float]] = []
    plain: list[dict[int, float]] = []
    memcpy: list[float] = []
    with tempfile.TemporaryDirectory(prefix="comm-vs-torch-") as tmp:
        for round_ in range(args.rounds):
            memcpy.append(memcpy_bandwidth())
            for side in ("sail", "plain") if round_ % 2 == 0 else ("plain", "sail"):
                if side == "sail":
                    sail.append(run_sail(args, Path(tmp)))
                else:
                    plain.append(run_plain(args, sizes, Path(tmp)))
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(
        f"all-reduce, float32, {WORLD} gloo processes on this machine ({os.cpu_count()} CPUs), "
        f"{args.iters} timed after {args.warmup} warm-up per size, median of {args.rounds} alternating rounds, "
        f"torch {torch.__version__}"
    )
    report(sizes, sail, plain, statistics.median(memcpy))


if __name__ == "__main__":
    main()
