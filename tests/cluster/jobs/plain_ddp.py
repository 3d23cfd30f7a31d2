"""A plain torchrun script, no SpikingSail inside: env:// process group, DDP, a few steps.

plain_ddp.py OUT_DIR
"""

import hashlib
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "host": socket.gethostname(),
        "digest": digest,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    # DDP's C++ reducer must not be the last owner of the gloo group: freed after
    # destroy_process_group it joins gloo's threads while holding the GIL, and a thread that
    # needs the GIL to drop its last work item hangs the exit (torch 2.13, now and then).
    del model, optimizer
    dist.destroy_process_group()
    # Even so, in a plain script DDP keeps the group, and gloo's threads, alive past
    # destroy_process_group. A work item launched inside backward() carries a Python object;
    # when a gloo thread frees it during interpreter finalization, taking the GIL ends the
    # thread inside a noexcept destructor: "terminate called without an active exception",
    # SIGABRT, in about one run in twenty on 2 cores (pytorch/pytorch#190489). Leave without
    # finalizing: everything this job promised is on disk.
    os._exit(0)


if __name__ == "__main__":
    main()
