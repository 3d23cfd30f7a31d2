"""A killed worker: live recovery from a peer (``--ft-replicas``) against today's restart from a checkpoint.

    python benchmarks/live_recovery.py                 # kill at step 20 of 60, hidden width 256
    python benchmarks/live_recovery.py --hidden 1024 --kill-step 30

Both runs train tests/fault/replica_worker.py (a regression MLP, the same data and global batch of
8 samples per step, checkpoints every 6 steps, 50 ms of sleep per step so that both groups are in
step before the kill) on this machine, and SIGKILL one worker once it reaches the kill step:

- **live**: ``sail launch --ft-replicas 2 -n 1 --max-restarts 3`` (two replica groups of one process);
  group 1 dies, its agent restarts it, and it heals from group 0 while group 0 trains on.
- **restart**: ``sail launch -n 2 --max-restarts 3 ... --checkpoints DIR --resume`` (plain DDP); rank
  1 dies, torchrun stops and restarts both ranks, and they resume the last checkpoint.

From every committed step's wall-clock time (the worker's ledger) and the kill's (its marker file):
the **survivor's stall** (the longest gap between two of its committed steps after the kill, less
the median step), the time until the **replacement is back in step** (the kill to its first
committed step), and the **steps redone** (committed a second time after a restart). A third and
fourth run, without a fault, the sleep or checkpoints, compare the median step time of the two (the
steady-state cost of torchft's quorum, vote and cross-group all-reduce), and a fifth and sixth (one
epoch) the same with ``--device-ms`` of sleep per step standing in for a GPU's compute, during which
the host only waits: that cost as a share of a realistic step. Prints the numbers and the ratios.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "fault" / "replica_worker.py"
SAIL = [sys.executable, "-m", "spikingsail.cli.main", "launch"]


def run(
    out: Path, live: bool, epochs: int, hidden: int, kill_step: int | None, sleep: float = 0.0
) -> list[dict[str, Any]]:
    out.mkdir(parents=True)
    flags = ["--ft-replicas", "2", "-n", "1"] if live else ["-n", "2"]
    args = [str(WORKER), str(out), str(epochs), "--hidden", str(hidden), "--step-sleep", str(sleep)]
    if kill_step is not None:
        args += ["--kill-group", "1" if live else "0", "--kill-rank", "0" if live else "1",
                 "--kill-step", str(kill_step)]  # fmt: skip
    if not live and kill_step is not None:  # the restart's checkpoints; steady-state runs save none
        args += ["--checkpoints", str(out / "ckpt"), "--resume"]
    done = subprocess.run([*SAIL, *flags, "--max-restarts", "3", *args], capture_output=True, text=True,
                          check=False, cwd=ROOT)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(
            f"{'live' if live else 'restart'} run failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        )
    entries = []
    for path in out.glob("ledger-*.jsonl"):
        group, pid = path.stem.split("-")[1:]
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if "step" in entry:  # a committed step (not what a step took before its exchange)
                entries.append({**entry, "group": int(group), "pid": int(pid)})
    return sorted(entries, key=lambda e: e["time"])


def survivor(entries: list[dict[str, Any]], live: bool) -> list[dict[str, Any]]:
    """Group 0's process (live), or rank 0's processes (restart)."""
    return [e for e in entries if (e["group"] == 0 if live else e["rank"] == 0)]


def median_step(entries: list[dict[str, Any]]) -> float:
    times = [e["time"] for e in entries]
    return statistics.median([b - a for a, b in itertools.pairwise(times)])


def fault_numbers(entries: list[dict[str, Any]], killed_at: float, live: bool) -> dict[str, float]:
    mine = survivor(entries, live)
    step = median_step([e for e in mine if e["time"] < killed_at])
    after = [e["time"] for e in mine if e["time"] >= killed_at]
    before = max(e["time"] for e in mine if e["time"] < killed_at)
    gaps = [b - a for a, b in zip([before, *after], after, strict=False)]
    started_before = {e["pid"] for e in entries if e["time"] <= killed_at}
    replacement = [e for e in entries if e["pid"] not in started_before]
    counts = collections.Counter(e["step"] for e in mine)
    return {
        "stall_s": max(gaps) - step,
        "back_in_step_s": replacement[0]["time"] - killed_at,
        "steps_redone": sum(c - 1 for c in counts.values()),
        "median_step_s": step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=5, help="12 steps each")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument(
        "--device-ms", type=float, default=200.0,
        help="a last steady-state pair with this much sleep per step, standing in for a GPU's compute "
             "(the host waits on the device meanwhile): the fixed cost per step as a share of such a step",
    )  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {}
        for name, live in (("live (--ft-replicas 2)", True), ("restart (--max-restarts, checkpoint)", False)):
            out = Path(tmp) / name.split()[0]
            entries = run(out, live, args.epochs, args.hidden, args.kill_step, sleep=0.05)
            killed_at = float((out / f"killed-{1 if live else 0}").read_text())
            rows[name] = fault_numbers(entries, killed_at, live)
        steady, device = {}, {}
        for name, live in (("live", True), ("plain", False)):
            entries = run(Path(tmp) / f"steady-{name}", live, args.epochs, args.hidden, None)
            steady[name] = median_step(survivor(entries, live))
            if args.device_ms > 0:
                entries = run(
                    Path(tmp) / f"device-{name}", live, 1, args.hidden, None, sleep=args.device_ms / 1000
                )
                device[name] = median_step(survivor(entries, live))
    print(f"one worker SIGKILLed at step {args.kill_step} of {args.epochs * 12}; hidden width {args.hidden}")
    print(f"{'':40}{'stall s':>10}{'back in step s':>16}{'steps redone':>14}{'median step s':>15}")
    for name, row in rows.items():
        print(f"{name:40}{row['stall_s']:>10.2f}{row['back_in_step_s']:>16.2f}{row['steps_redone']:>14.0f}"
              f"{row['median_step_s']:>15.4f}")  # fmt: skip
    print(f"steady state, no fault: median step {steady['live']:.4f} s with replica groups, {steady['plain']:.4f} s "
          f"plain DDP: ratio {steady['live'] / steady['plain']:.2f}, "
          f"+{(steady['live'] - steady['plain']) * 1000:.1f} ms per step")  # fmt: skip
    if device:
        print(f"with {args.device_ms:.0f} ms of device time per step (sleep): median step {device['live']:.4f} s "
              f"with replica groups, {device['plain']:.4f} s plain DDP: ratio {device['live'] / device['plain']:.3f}, "
              f"+{(device['live'] - device['plain']) * 1000:.1f} ms per step")  # fmt: skip


if __name__ == "__main__":
    main()
