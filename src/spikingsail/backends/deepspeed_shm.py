"""DeepSpeed's shared-memory all-reduce workspaces on a CPU node, let go once every rank has them.

Where every rank of a job is on one node (``LOCAL_SIZE``, which DeepSpeed's own launcher sets, equal
to the world size), DeepSpeed's communication on its CPU accelerator gives each rank a 66 MB POSIX
shared-memory workspace, ``/dev/shm/deepspeed_allreduce_buffer_UID_ADDR_PORT_RANK``, and maps every
other rank's. Nothing unlinks them: each run left LOCAL_SIZE × 66 MB of the node's memory in
``/dev/shm`` until a reboot, whether the job ended well or was killed. Once every rank has mapped every
workspace (a barrier after ``deepspeed.initialize``, whose communication setup maps them), each rank
unlinks its own name: the mappings stay, and the memory goes with the job's last process.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch.distributed as dist

SHARED_MEMORY = Path("/dev/shm")  # noqa: S108 (where glibc's shm_open keeps its names)


def workspace(rank: int) -> Path:
    """This rank's workspace, named as DeepSpeed's ``shm_initialize`` names it (``shm.cpp``)."""
    where = f"{os.environ.get('MASTER_ADDR', '')}_{os.environ.get('MASTER_PORT', '')}"
    return SHARED_MEMORY / f"deepspeed_allreduce_buffer_{os.getuid()}_{where}_{rank}"


def release_workspaces() -> None:
    """After ``deepspeed.initialize`` on every rank: unlink this rank's workspace, if DeepSpeed made one."""
    comm = sys.modules.get("deepspeed.comm.comm")
    backend = getattr(comm, "cdb", None)
    if getattr(backend, "shm_comm_op", None) is None or not dist.is_initialized():
        return
    if os.environ.get("LOCAL_SIZE", "").strip() != str(dist.get_world_size()):
        return  # ranks on several nodes: DeepSpeed made none
    dist.barrier()  # every rank has mapped every workspace
    with contextlib.suppress(FileNotFoundError):  # a second engine in this process: gone already
        workspace(dist.get_rank()).unlink()
