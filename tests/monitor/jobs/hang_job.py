"""A job that hangs on purpose, for the hang-watch tests.

hang_job.py LOG_DIR --fault stop|deadlock|none [--rank R] [--step S] [--timeout SECONDS] [--steps N]
            [--until FILE]

Rank R, at optimizer step S, either stops itself with a real SIGSTOP or deadlocks in Python (a lock
it already holds); the other ranks go on into the next step's gradient sync and wait there. Every
rank writes LOG_DIR/pid{RANK} when it starts and LOG_DIR/training{RANK} after its second optimizer
step; the rank that started its node's hang watch writes LOG_DIR/watch{RANK}.json: the watch's pid and
the addresses it listens on. ``--fault none`` trains to the end: ``--steps`` steps, or with
``--until`` until FILE exists.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import spikingsail


def deadlock() -> None:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # never returns


def listening(pid: int) -> list[str]:
    """The TCP addresses (``ip:port``) process ``pid`` listens on, from its network namespace's
    /proc/net/tcp and tcp6 and its open sockets."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                found.append(_address(fields[1]))
    return found


def _address(field: str) -> str:
    raw, port = field.split(":")
    data = bytes.fromhex(raw)
    # the kernel prints each 32-bit word in host (little-endian) order
    words = b"".join(data[i : i + 4][::-1] for i in range(0, len(data), 4))
    ip = ipaddress.ip_address(words)
    return f"[{ip}]:{int(port, 16)}" if ip.version == 6 else f"{ip}:{int(port, 16)}"


def watch_of(pid: int) -> int | None:
    """The hang watch that process ``pid`` started, if any."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid and b"hangwatch.py" in cmdline:
            return int(proc.name)
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("log_dir", type=Path)
    parser.add_argument("--fault", choices=["stop", "deadlock", "none"], default="stop")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=4)
    parser.add_argument("--until", type=Path)
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
    watch = watch_of(os.getpid())
    if watch is not None:
        found = {"pid": watch, "listening": listening(watch)}
        partial = args.log_dir / f"watch{engine.rank}.json.partial"
        partial.write_text(json.dumps(found))
        partial.replace(partial.with_suffix(""))  # whole when it appears
    g = torch.Generator().manual_seed(100 + engine.rank)
    for step in range(10**9 if args.until else args.steps):
        if args.until and step % 10 == 0:  # every rank stops at the same step
            stop = torch.tensor([float(args.until.exists())])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
        if engine.rank == args.rank and step == args.step:
            if args.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif args.fault == "deadlock":
                deadlock()
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
        if step == 1:
            (args.log_dir / f"training{engine.rank}").touch()
        time.sleep(0.01)
    engine.close()


if __name__ == "__main__":
    main()
