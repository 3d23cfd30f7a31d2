"""The doctor's last check: a real all-reduce over every process, started and joined like a training job.

Started by `sail launch` (``... -m spikingsail.diagnostics.allreduce``, or this file's path for
launchers that run a script), every rank finds its place and joins the process group through the
engine's own code (``discover_rank_info``, ``select_device``, ``join_process_group``: nccl with the
GPU of its local rank, gloo on CPUs), all-reduces 1 MiB holding its rank + 1, and checks the sum.
Rank 0 prints ``SAIL_ALLREDUCE {json}``.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from spikingsail.backends import load_config
from spikingsail.backends.process_group import (
    join_process_group,
    leave_process_group,
    rank_hosts,
    select_device,
)
from spikingsail.environments import discover_rank_info
from spikingsail.errors import SailError
from spikingsail.exits import exit_now

MARKER = "SAIL_ALLREDUCE "
ELEMENTS = 1 << 18  # 1 MiB of float32


def main() -> int:
    started = time.monotonic()
    try:
        info = discover_rank_info()
        config = load_config(
            {"train_micro_batch_size_per_gpu": 1, "sail": {"timeout_minutes": 1}}, info.world_size
        )
        device = select_device(info)
        join_process_group(config.sail, config.source, info, device)
    except SailError as err:
        print(f"sail doctor: {err}", file=sys.stderr)
        return 2
    try:
        values = torch.full((ELEMENTS,), float(info.rank + 1), device=device)
        dist.all_reduce(values)
        expected = info.world_size * (info.world_size + 1) / 2
        wrong = int((values != expected).sum())
        hosts = rank_hosts(info.world_size)
        backend = dist.get_backend()
    finally:
        leave_process_group()
    if wrong:
        print(f"rank {info.rank}: {wrong} of {ELEMENTS} elements differ from {expected}", file=sys.stderr)
        return 1
    if info.rank == 0:
        result = {"world_size": info.world_size, "backend": backend, "hosts": hosts,
                  "seconds": time.monotonic() - started}  # fmt: skip
        print(MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    exit_now(main())
