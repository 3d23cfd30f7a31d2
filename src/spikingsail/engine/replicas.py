"""Live recovery across replica groups with torchft (``sail launch --ft-replicas R``).

The job is R replica groups of n processes each, every group under its own torchrun agent; within
a group the backend (DDP) all-reduces gradients as always, and across groups torchft's ``Manager``
does, with a quorum taken at the start of every optimizer step. When a group dies the others keep
stepping; when it comes back it heals from a live peer's memory instead of reloading a checkpoint.

What SpikingSail adds to torchft, so that a fault changes nothing in the training:

- **The samples of every step are those of the fault-free run.** A step's global batch (micro-batch ×
  n × R per micro-step) is split among the ranks of the groups *taking part in that step*, so while a
  group is missing the others take its share; each rank's loss is weighted by its share, and the
  groups' gradients are summed, so the step's gradient is the mean over the same global batch.
  A step that fails (a peer died during the all-reduce) is not committed and is taken again with
  the same samples. Positions are derived from the committed step count: a healed group continues
  from the peer's.
- **A step is committed only when torchft's vote says so**: the optimizer, the scheduler, the
  counters and the data position advance only then.
- **A group that joins a running job heals at ``initialize``**: it takes its first quorum there
  (torchft, with a synchronous quorum, loads a live group's model, optimizer and engine state into
  it), so it leaves ``initialize`` at the others' step with their weights, and the loaders the
  script makes next continue at the job's epoch and position; it takes part in that very step.
  A group that is part of the quorum but not taking part in a step (torchft's spares) trains on a
  share nobody counts: the manager sends zeros for it.

torchft's ``DistributedDataParallel`` wrapper is not used: its comm hook asserts on a failed
all-reduce (``torchft/ddp.py``) and crashes the survivor. The engine all-reduces the gradients
through the manager after the group's own DDP all-reduce and reads each work's result instead.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from spikingsail.config.schema import FaultToleranceConfig, SailConfig
from spikingsail.data.sampler import split_batch
from spikingsail.environments import RankInfo
from spikingsail.environments.replica_groups import (
    ENV_GROUP,
    ENV_GROUPS,
    ENV_LIGHTHOUSE,
    ENV_SECRET,
    SECRET_BYTES,
    address_on_route_to,
)
from spikingsail.errors import ConfigError, SailError

log = logging.getLogger(__name__)

AGENT_WATCH_SECONDS = 0.5


@dataclass(frozen=True, slots=True)
class ReplicaEnv:
    """Where this process is among the replica groups, as ``sail launch --ft-replicas`` says."""

    group: int
    groups: int
    lighthouse: str
    secret: bytes = field(default=b"", repr=False)
    """What a group's state is signed with for another group to load it (``replica_transport``)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ReplicaEnv | None:
        env = os.environ if env is None else env
        if ENV_GROUPS not in env:
            return None
        try:
            group, groups = int(env[ENV_GROUP]), int(env[ENV_GROUPS])
        except (KeyError, ValueError):
            raise ConfigError(
                f"{ENV_GROUPS}={env.get(ENV_GROUPS)!r} but {ENV_GROUP}={env.get(ENV_GROUP)!r}",
                "a replica group needs its number and the number of groups, both integers",
                "start the job with sail launch --ft-replicas R",
            ) from None
        if not 0 <= group < groups or ENV_LIGHTHOUSE not in env:
            raise ConfigError(
                f"replica group {group} of {groups}, lighthouse {env.get(ENV_LIGHTHOUSE)!r}",
                "the group must be one of 0..R-1 and the lighthouse's address must be set",
                "start the job with sail launch --ft-replicas R",
            )
        return cls(group, groups, env[ENV_LIGHTHOUSE], _secret(env.get(ENV_SECRET, "")))


def _secret(text: str) -> bytes:
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != SECRET_BYTES:
        raise ConfigError(
            f"{ENV_SECRET} is {'not set' if not text else 'not ' + str(2 * SECRET_BYTES) + ' hex digits'}",
            "a replica group loads another group's state only when it is signed with the job's secret",
            f"start the job with sail launch --ft-replicas R, which sets it; or set {ENV_SECRET} to the "
            f"same {2 * SECRET_BYTES} hex digits (python -c 'import secrets; print(secrets.token_hex())') "
            "for every group",
        )
    return secret


def check_supported(config: SailConfig, backend: str, sync_batch_norm: str | None = None) -> None:
    """Refuse, before anything starts, what live recovery cannot yet keep exact. ``sync_batch_norm``:
    what synchronises batch-norm statistics in this job, if anything."""
    from spikingsail.backends import available, backend_class

    where = config.source
    chosen = backend_class(backend, where)
    # the others are imported (to ask) only to name them in a refusal
    able = (
        [] if chosen.replica_groups else [name for name in available() if backend_class(name).replica_groups]
    )
    refusals = [
        (not chosen.replica_groups, f"sail.backend is {backend!r}",
         f"only the {' and '.join(able)} backends all-reduce across replica groups through torchft so far",
         "use " + " or ".join(f'"sail": {{"backend": "{name}"}}' for name in able) + ", or launch without --ft-replicas"),
        (config.fp16.enabled, "fp16 is enabled",
         "a loss scaler that skips a step on one group and not another would let the groups diverge",
         "use bf16 or fp32 with --ft-replicas"),
        *[(True, *refusal) for refusal in [chosen.replica_refusal(config)] if refusal is not None],
        (config.sail.balance != "off", "sail.balance is set",
         "with --ft-replicas the shares of a step follow the groups taking part in it",
         "turn sail.balance off"),
        (sync_batch_norm is not None, f"batch statistics are synchronised ({sync_batch_norm})",
         "torchft sums gradients across the groups, but batch statistics stay within a group, so each "
         "group would normalise over its own share of the batch, not over the whole global batch",
         "use plain batch norm (per-rank statistics, as DDP has them), or launch without --ft-replicas"),
    ]  # fmt: skip
    for refused, what, why, fix in refusals:
        if refused:
            raise ConfigError(
                f"{where}: {what}, and the job runs as replica groups (--ft-replicas)", why, fix
            )


class ReplicaGroups:
    """This process's torchft ``Manager`` and the step protocol around it."""

    def __init__(
        self,
        config: FaultToleranceConfig,
        env: ReplicaEnv,
        rank_info: RankInfo,
        device: torch.device,
        state: tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]],
        tensors: Callable[[], Iterable[torch.Tensor]],
    ) -> None:
        from torchft import Manager
        from torchft.process_group import ProcessGroupBabyNCCL

        from spikingsail.engine.replica_transport import (
            BoundGloo,
            QuorumIds,
            SignedStateTransport,
            manager_bound_to,
        )

        self.env = env
        self.group_size = rank_info.world_size
        self.group_rank = rank_info.rank
        timeout = timedelta(seconds=config.timeout_seconds)
        # every socket of torchft's here on the address the other groups reach this one at
        address = address_towards_lighthouse(env.lighthouse)
        pg = ProcessGroupBabyNCCL(timeout=timeout) if device.type == "cuda" else BoundGloo(address, timeout)
        _forget_previous_manager(rank_info)
        _end_with_the_agent(env.group)
        get_state, load_state = state
        self._transport = SignedStateTransport(pg, env.secret, device)  # not torchft's HTTP server
        with manager_bound_to(address):
            self.manager = _manager(Manager, config, env, rank_info, pg, address, self._transport)
        self.manager._client = QuorumIds(self.manager._client)  # no public way to reach it
        self.manager.register_state_dict_fn("sail", load_state, get_state)
        self.device, self._tensors = device, tensors
        self._in_step = False
        self._checked_quorum: int | None = None

    # -- a step --------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Take the step's quorum (once per optimizer step); a group behind the others heals here."""
        if not self._in_step:
            before = self.manager.current_step()
            self.manager.start_quorum()
            self._in_step = True
            error = self.manager.errored()
            healed = self.manager.current_step()
            if (
                error is None
                and healed != before
                and self._checked_quorum is not None
                and self.group_rank == 0
            ):
                log.warning("replica group %d was left behind (at step %d) and healed from a live group: "
                            "now at step %d", self.env.group, before, healed)  # fmt: skip
            if error is not None and error.original_exception is self._transport.send_error:
                # only sending this rank's state failed (the healing group went away): the step
                # fails, and this group's state is its own
                log.warning("replica group %d, rank %d: sending its state to a healing group failed "
                            "(%r): the step is taken again", self.env.group, self.group_rank,
                            error.original_exception)  # fmt: skip
            elif error is not None and self.group_size > 1:
                # torchft heals each rank from its counterpart in a live group; when that fails on one
                # rank and not on another, the group's ranks hold different states and torchft does
                # not heal them again (the group's step is already the others'): restart the group.
                raise SailError(
                    f"replica group {self.env.group}, rank {self.group_rank}: torchft's quorum or heal "
                    f"failed ({error.original_exception!r})",
                    "the other ranks of this group may have healed, and a group whose ranks hold "
                    "different states would train apart",
                    "nothing to do: the process stops so that its torchrun agent restarts the group "
                    "(keep --max-restarts above 0), and the restarted group heals from a live one",
                )
            quorum = self.manager._quorum_id  # torchft keeps no public name for it
            if error is None and quorum != self._checked_quorum:
                self._checked_quorum = quorum
                self._agree_on_state()

    def _agree_on_state(self) -> None:
        """When the quorum changes, the groups taking part compare fingerprints of their parameters and
        optimizer state. torchft heals only a group *behind* the others; two groups at the same step
        holding different states (each trained alone while the lighthouse kept them apart, or a
        silent corruption) would otherwise go on training apart. Then every group votes no on this
        step, and each group whose state is not the first group's steps its torchft step back by one,
        so the next quorum heals it from a group that kept the first group's state."""
        groups, me = self.manager.num_participants(), self.manager.participating_rank()
        if groups < 2 or me is None:
            return
        mine = fingerprint(self._tensors(), self.device)
        slots = torch.zeros(groups, dtype=torch.int64, device=self.device)
        slots[me] = mine
        self.manager.allreduce(slots, reduce_op=_sum()).wait()
        if self.manager.errored() is not None or bool((slots == slots[0]).all()):
            return  # a failed all-reduce: the vote says no anyway
        apart, step = int((slots != slots[0]).sum()), self.manager.current_step()
        if int(slots[me]) != int(slots[0]):
            self.manager.load_state_dict({"step": max(step - 1, 0),
                                          "batches_committed": self.manager.batches_committed()})  # fmt: skip
        log.warning(
            "replica groups at step %d hold different states (%d of %d differ from the first group's): "
            "the step is taken again after they heal from it", step, apart, groups,
        )  # fmt: skip
        self.manager.report_error(SailError(f"replica groups hold different states at step {step}"))

    def split(self, samples: int) -> tuple[list[int], int | None]:
        """The shares of ``samples`` among the ranks of the groups taking part in this step, and this
        rank's index among them (None when its group is healing and takes part with no samples)."""
        self.begin_step()
        groups = self.manager.num_participants()
        shares = split_batch(samples, [1.0] * (groups * self.group_size))
        participating = self.manager.participating_rank()
        index = None if participating is None else participating * self.group_size + self.group_rank
        return shares, index

    def reduce_and_vote(self, parameters: Iterator[torch.nn.Parameter]) -> bool:
        """Sum every gradient over the groups (a missing one counts as zero), in buckets of up to
        ``BUCKET_BYTES`` as DDP does, then vote: True when the step commits everywhere."""
        self.begin_step()
        grads = []
        for parameter in parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            grads.append(local(parameter.grad))  # fsdp: this rank's shard, the same in every group
        buckets = [(bucket, torch.cat([g.reshape(-1) for g in bucket])) for bucket in _buckets(grads)]
        works = [self.manager.allreduce(flat, reduce_op=_sum()) for _, flat in buckets]
        for work in works:
            work.wait()  # a failed one reports its error to the manager, which then votes no
        committed = bool(self.manager.should_commit())
        if committed:
            for bucket, flat in buckets:
                offset = 0
                for grad in bucket:
                    grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                    offset += grad.numel()
        self._in_step = False
        return committed

    def state_dict(self) -> dict[str, Any]:
        """torchft's own counters (committed steps and batches), kept in the engine's checkpoints."""
        return dict(self.manager.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(state)

    def shutdown(self) -> None:
        """Stop torchft's servers and threads and free the cross-group process group now, in order,
        not at interpreter exit (where a gloo thread still joinable aborted a finished process). A
        quorum still waiting for the lighthouse (an error path) is not waited for."""
        pending = getattr(self.manager, "_quorum_future", None)
        self.manager.shutdown(wait=pending is None or pending.done())
        self.manager._pg.shutdown()  # torchft's own name; its wrapper drops the gloo/NCCL group


def _manager(
    manager: Any, config: FaultToleranceConfig, env: ReplicaEnv, rank_info: RankInfo, pg: Any,
    address: str, transport: Any,
) -> Any:  # fmt: skip
    """torchft's ``Manager`` for this rank, advertising ``address``, healing through ``transport``."""
    timeout = timedelta(seconds=config.timeout_seconds)
    return manager(
        pg=pg,
        checkpoint_transport=transport,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=config.min_replicas,
        use_async_quorum=False,  # a healing group loads the peer's state inside start_quorum
        timeout=timeout,
        quorum_timeout=timedelta(seconds=config.quorum_timeout_seconds),
        connect_timeout=timedelta(seconds=config.connect_timeout_seconds),
        rank=rank_info.rank,
        world_size=rank_info.world_size,
        lighthouse_addr=env.lighthouse,
        replica_id=f"sail_{env.group}",
        hostname=address,
        quorum_retries=config.quorum_retries,
    )


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
_CHUNK = 2**20
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A 62-bit fingerprint of the tensors' exact bits (position-weighted sums of their bit patterns):
    a differing bit changes it, unless its weighted change is a multiple of 2**62."""
    total = torch.zeros((), dtype=torch.int64, device=device)
    for index, tensor in enumerate(tensors, start=1):
        flat = local(tensor).detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        bits = flat.view(_BITS[flat.element_size()])
        for start in range(0, bits.numel(), _CHUNK):  # int64 copies of a chunk at a time, not the model
            part = bits[start : start + _CHUNK].to(device=device, dtype=torch.int64)
            weights = torch.arange(start + 1, start + part.numel() + 1, dtype=torch.int64, device=device)
            total += (part * weights).sum() * index  # int64 arithmetic wraps: still a fingerprint
    return total & (2**62 - 1)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor (FSDP2's parameters, gradients
    and optimizer state; a view, so writing to it writes the shard), else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one dtype and device, up to ``BUCKET_BYTES`` a bucket."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for grad in grads:
        last = buckets[-1] if buckets else None
        nbytes = grad.numel() * grad.element_size()
        if (
            last is None
            or size + nbytes > BUCKET_BYTES
            or (last[0].dtype, last[0].device) != (grad.dtype, grad.device)
        ):
            buckets.append([grad])
            size = nbytes
        else:
            last.append(grad)
            size += nbytes
    return buckets


def address_towards_lighthouse(lighthouse: str) -> str:
    """Where the other groups reach this group's manager: this node's address on its route to the
    lighthouse (loopback when the groups share one machine, the cluster network's address when they
    are spread over nodes: ``sail launch`` runs the lighthouse on a machine of that network)."""
    parsed = urllib.parse.urlsplit(lighthouse)
    try:
        return address_on_route_to(parsed.hostname or "127.0.0.1", parsed.port or 29510)
    except OSError as err:
        raise ConfigError(
            f"{ENV_LIGHTHOUSE}={lighthouse}: no route to it from {socket.gethostname()} ({err})",
            "the replica groups reach each other and torchft's lighthouse over the network",
            "start the job with sail launch --ft-replicas R, from a machine the nodes can reach",
        ) from None


def _end_with_the_agent(group: int) -> None:
    """torchrun's agent stops its workers when it ends, but killed (SIGKILL, its node lost) it cannot,
    and its worker would stay in the quorum under the group's name while ``sail launch`` starts the
    group again. Under torchrun, a worker of a replica group ends when its agent is gone."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    agent = os.getppid()

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(AGENT_WATCH_SECONDS)
        log.error("replica group %d: the torchrun agent (pid %d) of this worker is gone; the worker "
                  "ends so that the group can be started again", group, agent)  # fmt: skip
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="sail-agent-watch", daemon=True).start()


def _forget_previous_manager(rank_info: RankInfo) -> None:
    """Rank 0's manager publishes its address in the group's store, where the other ranks read it.
    After torchrun restarts a group's workers the store still holds the address of the manager
    that died with them, and a rank that read it would wait for a quorum that never comes: rank 0
    removes it, and nobody reads before it is gone."""
    if rank_info.world_size == 1 or not dist.is_initialized():
        return
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    if rank_info.rank == 0:
        store = TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, wait_for_workers=False
        )
        for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
            store.delete_key(key)
    dist.barrier()


def _sum() -> Any:
    from torch.distributed import ReduceOp

    return ReduceOp.SUM
