"""Launch overhead: ``sail launch -n 2`` against ``torchrun --standalone --nproc-per-node 2``, one run.

    python benchmarks/launch_overhead.py               # 2 processes, 7 runs of each, alternately
    python benchmarks/launch_overhead.py --nproc 4 --repeats 11

The job joins a gloo group, all-reduces one tensor and exits: what is measured is the time from
starting the command to its exit (whole-process wall time), so what the launcher adds before the
agent starts, and after the workers exit, is all there is to see. The two commands run alternately
so that a busy machine slows both alike; the medians and their ratio are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)
assert value.item() == dist.get_world_size()
dist.destroy_process_group()
"""


def timed(argv: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    bin_dir = Path(sys.executable).parent
    commands = {
        "torchrun": [
            str(bin_dir / "torchrun"),
            "--standalone",
            "--nproc-per-node",
            str(args.nproc),
            "job.py",
        ],
        "sail launch": [str(bin_dir / "sail"), "launch", "-n", str(args.nproc), "job.py"],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        (cwd / "job.py").write_text(JOB)
        for argv in commands.values():  # warm the page cache and Python's bytecode caches
            timed(argv, cwd)
        for _ in range(args.repeats):
            for name, argv in commands.items():
                times[name].append(timed(argv, cwd))
    base = statistics.median(times["torchrun"])
    print(
        f"\n{'command':14} {'median s':>9} {'min s':>7} {'÷ torchrun':>10}   ({args.repeats} runs, {args.nproc} processes, {os.cpu_count()} CPUs)"
    )
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:14} {median:9.2f} {min(values):7.2f} {median / base:10.2f}")


if __name__ == "__main__":
    main()
