"""The doctor's last check: a real all-reduce over every process, started like a training job.

Run by torchrun (``sail launch ... -m spikingsail.diagnostics.allreduce``): every rank joins the
process group as the engine would (nccl with the GPU of its local rank, gloo on CPUs), all-reduces
1 MiB holding its rank + 1, and checks the sum. Rank 0 prints ``SAIL_ALLREDUCE {json}``.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

MARKER = "SAIL_ALLREDUCE "
ELEMENTS = 1 << 18  # 1 MiB of float32


def main() -> int:
    started = time.monotonic()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    try:
        values = torch.full((ELEMENTS,), float(rank + 1), device=device)
        dist.all_reduce(values)
        expected = world * (world + 1) / 2
        wrong = int((values != expected).sum())
        hosts: list[str | None] = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())
    finally:
        dist.destroy_process_group()
    if wrong:
        print(f"rank {rank}: {wrong} of {ELEMENTS} elements differ from {expected}", file=sys.stderr)
        return 1
    if rank == 0:
        result = {
            "world_size": world,
            "backend": backend,
            "hosts": hosts,
            "seconds": time.monotonic() - started,
        }
        print(MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
