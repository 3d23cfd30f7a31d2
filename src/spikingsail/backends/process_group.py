"""Joining and leaving the default torch.distributed process group."""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import socket

import torch
import torch.distributed as dist
from torch.distributed import HashStore, PrefixStore, Store, TCPStore  # type: ignore[attr-defined]  # public, not re-exported in stubs

from spikingsail.backends.base import Backend
from spikingsail.config.schema import SailConfig, SailSection
from spikingsail.environments import RankInfo, RankSource
from spikingsail.errors import BackendError, first_line

log = logging.getLogger(__name__)


def select_device(rank_info: RankInfo) -> torch.device:
    """One GPU per process chosen by local rank when CUDA is present, the CPU otherwise. A process
    that sees exactly one GPU uses it, whatever its local rank: SLURM's ``--gpus-per-task=1`` (what
    ``sail submit`` writes for one task per process) binds each task to its own GPU, which every
    task sees as device 0."""
    if not torch.cuda.is_available():
        _refuse_a_mask_that_hides_every_gpu()
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 1:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        return device
    if rank_info.local_rank >= count:
        raise BackendError(
            f"local rank {rank_info.local_rank} needs GPU {rank_info.local_rank}, but this node shows {count}",
            "each process on a node uses the GPU with its local rank",
            "start at most as many processes per node as GPUs (--nproc-per-node), or check CUDA_VISIBLE_DEVICES",
        )
    device = torch.device("cuda", rank_info.local_rank)
    torch.cuda.set_device(device)
    return device


def _refuse_a_mask_that_hides_every_gpu() -> None:
    """A node with GPUs whose CUDA_VISIBLE_DEVICES names none of them (``--include node:4,5`` on a
    4-GPU node) would train on the CPU without a word. An empty mask (or -1) hides the GPUs on
    purpose, and a CPU-only torch cannot use them anyway."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    gpus = nvidia_gpus()
    if not mask or mask == "-1" or torch.version.cuda is None or not gpus:
        return
    raise BackendError(
        f"CUDA_VISIBLE_DEVICES={mask} leaves no GPU visible on {socket.gethostname()}, which has {gpus} "
        f"(0-{gpus - 1})",
        "the mask names GPUs this node does not have (a slot list from --include, or a mask set by hand), "
        "and the job would train on the CPU",
        f"choose slots from 0 to {gpus - 1} (--include HOST:0,1), or unset CUDA_VISIBLE_DEVICES",
    )


def nvidia_gpus() -> int:
    """The NVIDIA GPUs the driver knows on this node, whatever CUDA_VISIBLE_DEVICES says."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def dist_backend_for(sail: SailSection, source: str, device: torch.device) -> str:
    """``sail.dist_backend`` on ``device`` (``source``: the config, named in the error)."""
    wanted = sail.dist_backend
    if wanted == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if wanted == "nccl" and device.type != "cuda":
        raise BackendError(
            f"{source}: sail.dist_backend is nccl but no GPU is visible",
            "NCCL only moves tensors between GPUs",
            "use dist_backend auto or gloo on CPU machines",
        )
    return wanted


def join_process_group(sail: SailSection, source: str, rank_info: RankInfo, device: torch.device) -> bool:
    """Create the default group (``sail``'s dist backend and timeout; ``source``: the config, named in
    errors); False when it already existed (created by the user) or is not needed."""
    if not rank_info.distributed or dist.is_initialized():
        return False
    if rank_info.source is RankSource.HOROVOD and "MASTER_ADDR" not in os.environ:
        raise BackendError(
            f"{source}: backend {sail.backend} was started by plain horovodrun",
            "horovodrun's rendezvous serves Horovod only; torch.distributed needs MASTER_ADDR and MASTER_PORT",
            'launch with `sail launch --launcher horovodrun` (it exports both), export them, or set "sail": '
            '{"backend": "horovod"}',
        )
    backend = dist_backend_for(sail, source, device)
    timeout = datetime.timedelta(minutes=sail.timeout_minutes)
    log.debug("joining %s process group at %s as rank %d", backend, rank_info.init_method(), rank_info.rank)
    store = rendezvous_store(rank_info, timeout)
    _agree_on_backend(store, rank_info, backend, device)
    try:
        init_default_group(backend, timeout, store, rank_info=rank_info, device=device)
    except (RuntimeError, ValueError) as err:
        raise BackendError(
            f"rank {rank_info.rank} could not join the {backend} process group at {rank_info.init_method()}",
            first_line(err),
            "check that MASTER_ADDR resolves and MASTER_PORT is reachable from every node "
            "(`sail doctor -H hostfile` checks both)",
        ) from err
    return True


def init_default_group(
    backend: str, timeout: datetime.timedelta, store: Store, *, rank_info: RankInfo, device: torch.device
) -> None:
    """Create torch.distributed's default group on ``store``, as ``rank_info``'s rank; on a GPU the
    group is bound to the rank's own device (``device_id``). Every join of SpikingSail goes
    through here: the engine's backends and ``sail bench comm``."""
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank_info.rank,
        world_size=rank_info.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )


def _agree_on_backend(store: Store, rank_info: RankInfo, backend: str, device: torch.device) -> None:
    """Every rank must choose the same collective backend: a node without a visible GPU picks gloo
    while the others pick nccl, and the group would fail at its first collective, or hang. Each
    rank writes its choice; rank 0 reads them all (O(world size)) and writes the verdict."""
    store.set(f"sail_backend/{rank_info.rank}", f"{backend} {device} {socket.gethostname()}")
    if rank_info.rank == 0:
        choices = [store.get(f"sail_backend/{r}").decode() for r in range(rank_info.world_size)]
        odd = [(r, c) for r, c in enumerate(choices) if c.split()[0] != backend]
        verdict = ""
        if odd:
            r, choice = odd[0]
            theirs, their_device, host = choice.split(maxsplit=2)
            verdict = (f"rank {r} on {host} chose {theirs} ({their_device}) while rank 0 on "
                       f"{socket.gethostname()} chose {backend} ({device})")  # fmt: skip
            if len(odd) > 1:
                verdict += f", and {len(odd) - 1} more rank(s) differ too"
        store.set("sail_backend/verdict", verdict or "ok")
    verdict = store.get("sail_backend/verdict").decode()
    if verdict != "ok":
        raise BackendError(
            f"the ranks disagree on the collective backend: {verdict}",
            "nccl needs a GPU on every rank; a node where no GPU is visible (drivers, CUDA_VISIBLE_DEVICES) "
            "falls back to gloo, and a mixed group cannot communicate",
            "make a GPU visible on every node (`sail doctor -H hostfile` checks), or set "
            '"sail": {"dist_backend": "gloo"} for the whole job',
        )


_JOINS = itertools.count()


def rendezvous_store(rank_info: RankInfo, timeout: datetime.timedelta) -> Store:
    """The rendezvous store, with keys of their own for every restart of the workers (a store in
    this process's memory when it is the only one).

    Under torchrun the agent hosts the store and keeps it across restarts; torch's own env://
    join then reads the dead workers' gloo addresses and the restarted group hangs in
    connectFullMesh. A prefix per restart count gives each attempt clean keys.
    """
    if not rank_info.distributed:
        return HashStore()
    assert rank_info.master_addr is not None and rank_info.master_port is not None  # RankInfo checked
    store = TCPStore(
        rank_info.master_addr,
        rank_info.master_port,
        world_size=rank_info.world_size,
        is_master=not rank_info.use_env_store and rank_info.rank == 0,
        timeout=timeout,
    )
    # ... and a join count: a process that joins again (a second engine) must not read the keys
    # of its previous group, which torch names the same ("default_pg/0") every time.
    return PrefixStore(f"spikingsail/attempt{rank_info.restart_count}/join{next(_JOINS)}", store)


def rank_hosts(world_size: int) -> list[str]:
    """Every rank's host name, in rank order (a collective when a process group is up)."""
    hosts: list[object] = [socket.gethostname()] * world_size
    if dist.is_initialized():
        dist.all_gather_object(hosts, socket.gethostname())
    return [str(h) for h in hosts]


def forget_groups(*holders: object) -> None:
    """Drop every process group (or list of them) the holders keep in their attributes.

    A framework's objects (DeepSpeed's engine and optimizer, the ``_dp_group`` it puts on each
    parameter) outlive the engine in user code; a group they keep outlives destroy_process_group,
    and its gloo threads crash the interpreter's exit with SIGABRT (pytorch/pytorch#190489). Call
    it once the holders are done communicating.
    """
    for holder in holders:
        attributes = getattr(holder, "__dict__", None)
        if attributes is None:
            continue
        for name, value in list(attributes.items()):
            values = value if isinstance(value, (list, tuple)) and value else (value,)
            if all(isinstance(item, dist.ProcessGroup) for item in values):
                del attributes[name]


def leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class ProcessGroupBackend(Backend):
    """A backend on torch.distributed's default group: one device per process by local rank; the
    group is joined at ``setup`` unless it exists, and left at ``teardown`` only if joined here."""

    def __init__(self, config: SailConfig, rank_info: RankInfo) -> None:
        super().__init__(config, rank_info)
        self._owns_group = False

    def setup(self) -> torch.device:
        self.device = select_device(self.rank_info)
        self._owns_group = join_process_group(
            self.config.sail, self.config.source, self.rank_info, self.device
        )
        return self.device

    def teardown(self) -> None:
        if self._owns_group:
            leave_process_group()
            self._owns_group = False
