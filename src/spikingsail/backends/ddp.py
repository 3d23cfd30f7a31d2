"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced.

``zero_optimization.stage`` 1 shards the optimizer state with torch's ``ZeroRedundancyOptimizer``
(each rank steps the state of its share of the parameters, then broadcasts them); stages 2 and 3
need a backend that shards gradients and parameters.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from spikingsail.backends.process_group import ProcessGroupBackend
from spikingsail.config.schema import SailConfig
from spikingsail.environments import RankInfo
from spikingsail.errors import BackendError

if TYPE_CHECKING:
    # torch.distributed.optim imports FSDP and DTensor (a second of CPU): imported for ZeRO-1 only
    from torch.distributed.optim import ZeroRedundancyOptimizer

log = logging.getLogger(__name__)

# DDP's switch for the buffer broadcast before every forward (renamed in torch 2.14)
_FORWARD_SYNC = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)


class DDPBackend(ProcessGroupBackend):
    name = "ddp"
    max_zero_stage = 1
    replica_groups = True

    @classmethod
    def replica_refusal(cls, config: SailConfig) -> tuple[str, str, str] | None:
        if config.zero_optimization.stage == 0:
            return None
        return (f"zero_optimization.stage is {config.zero_optimization.stage}",
                "a healing group takes a peer's whole optimizer state; ZeRO-1 over ddp shards it on its own",
                'use stage 0, or "sail": {"backend": "fsdp"} to shard within each group')  # fmt: skip

    def __init__(self, config: SailConfig, rank_info: RankInfo) -> None:
        super().__init__(config, rank_info)
        self.ddp: DistributedDataParallel | None = None
        self.zero: ZeroRedundancyOptimizer | None = None
        self._norms: list[_BatchNorm] = []
        self._diverged = True  # until the first forward that reads them: a resume gives each rank its own
        self._eval_hook: RemovableHandle | None = None

    def wrap(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        if not self.rank_info.distributed:
            return model, optimizer
        device = next(model.parameters()).device
        norms = _batch_norms_holding_every_buffer(model)
        self.rank_buffers = norms is not None
        no_forward_sync: dict[str, Any] = {_FORWARD_SYNC: False} if norms is not None else {}
        self.ddp = DistributedDataParallel(
            model,
            device_ids=[device] if device.type == "cuda" else None,
            find_unused_parameters=self.config.sail.find_unused_parameters,
            **no_forward_sync,
        )
        if norms is not None:
            self._norms = norms
            self._eval_hook = self.ddp.register_forward_pre_hook(self._rank_zero_statistics_for_eval)
        if self.config.zero_optimization.stage == 1:
            optimizer = self.zero = _zero_redundancy(optimizer, self.config.source)
            if self.rank_info.is_rank_zero:
                log.info("ZeRO-1: optimizer state sharded over %d ranks (ZeroRedundancyOptimizer)",
                         self.rank_info.world_size)  # fmt: skip
        return self.ddp, optimizer

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        # DDP decides at forward time whether the following backward all-reduces, so the
        # engine enters this context around the forward of every micro-step.
        if self.ddp is None or enabled:
            return contextlib.nullcontext()
        return self.ddp.no_sync()

    # ZeRO-1: each rank writes and reads the optimizer state of its own share of the parameters
    # (one key per parameter, so the union is the whole optimizer, loadable by any backend).

    def checkpointed(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        module, optimizer = super().checkpointed()
        if self.zero is not None and optimizer is self.zero:
            local: torch.optim.Optimizer = self.zero.optim
            return module, local
        return module, optimizer

    def load_state(self, directory: Path, group: dist.ProcessGroup | None, *, with_optimizer: bool) -> None:
        if not with_optimizer:
            super().load_state(directory, group, with_optimizer=False)
            return
        with _without_empty_groups(self.checkpointed()[1]):
            super().load_state(directory, group, with_optimizer=True)
        self._diverged = True  # the checkpoint's own statistics of each rank follow

    def _rank_zero_statistics_for_eval(self, module: torch.nn.Module, args: Any) -> None:
        """Batch-norm running statistics are not broadcast before every forward (DDP's default: one
        collective per micro-step): a training forward uses the batch's own statistics and only
        updates each rank's running ones. Before a forward that reads them (a batch norm in eval
        mode), every rank takes rank 0's, as that broadcast would have given them."""
        if self._diverged and any(not norm.training for norm in self._norms):
            assert self.ddp is not None, "the hook is removed at teardown"
            with torch.no_grad():
                self.ddp._default_broadcast_coalesced(authoritative_rank=0)  # type: ignore[no-untyped-call]
            self._diverged = False
        if any(norm.training for norm in self._norms):
            self._diverged = True

    def state_to_save(self) -> dict[str, Any]:
        if not self.rank_buffers:
            return super().state_to_save()
        # rank 0's statistics in the checkpoint (DCP writes one rank's copy of a replicated tensor),
        # each rank's own left in place: a save changes nothing in the run (each rank's are saved too)
        from spikingsail.checkpoint import dcp_io

        module, optimizer = self.checkpointed()
        state = dcp_io.state_to_save(module, optimizer)
        buffers = {buffer.data_ptr() for buffer in module.buffers()}
        with torch.no_grad():
            for name, value in state["model"].items():  # the live buffers' tensors, by storage
                if isinstance(value, torch.Tensor) and value.data_ptr() in buffers:
                    rank_zeros = value.detach().clone()
                    dist.broadcast(rank_zeros, src=0)
                    state["model"][name] = rank_zeros
        return state

    def teardown(self) -> None:
        if self.zero is not None:
            # ZeRO-1's optimizer holds the group too and outlives the engine in user code (the
            # optimizer run() returned): the same exit crash as the reducer's below.
            del self.zero.process_group
            self.zero = None
        if self._eval_hook is not None:
            self._eval_hook.remove()
            self._eval_hook = None
        if self.ddp is not None:
            # DDP's C++ reducer (and the logger sharing it) hold the process group through a
            # binding that keeps the GIL while destroying what it holds. If the reducer ends up
            # as the group's last owner, gloo's worker threads, which need the GIL to finish
            # their last work item, are joined under it and the process hangs on exit. Drop
            # them while the group is still registered, so the group dies in
            # destroy_process_group, which releases the GIL.
            for name in ("logger", "reducer"):
                if hasattr(self.ddp, name):
                    delattr(self.ddp, name)
            # The module outlives the engine in user code (often as a global, freed during
            # interpreter shutdown); it must not keep the group, and gloo's threads, alive.
            del self.ddp.process_group
            self.ddp = None
        super().teardown()


def _batch_norms_holding_every_buffer(model: torch.nn.Module) -> list[_BatchNorm] | None:
    """The model's batch norms, when their running statistics are all the buffers it has (anything
    else a buffer may hold keeps DDP's broadcast before every forward); else None."""
    norms = [module for module in model.modules() if isinstance(module, _BatchNorm)]
    theirs = {id(buffer) for norm in norms for buffer in norm.buffers(recurse=False)}
    every = list(model.buffers())
    if not every or any(id(buffer) not in theirs for buffer in every):
        return None
    return norms


def _zero_redundancy(optimizer: torch.optim.Optimizer, where: str) -> ZeroRedundancyOptimizer:
    """The same optimizer class, groups and hyper-parameters, with its state sharded over ranks."""
    if optimizer.state:
        raise BackendError(
            f"{where}: zero_optimization.stage 1 needs an optimizer that has not stepped yet",
            "ZeRO-1 rebuilds the optimizer to shard its state; state gathered so far would be lost",
            "create the optimizer, then hand it to the engine before any optimizer.step()",
        )
    cls = type(optimizer)
    # defaults can hold entries the constructor does not take (AdamW's decoupled_weight_decay)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    # The given optimizer's own group dicts, not copies: a scheduler (or anything else) bound to the
    # given optimizer changes hyper-parameters that ZeRO steps with.
    return _zero_redundancy_class()(optimizer.param_groups, optimizer_class=cls, **defaults)


def _zero_redundancy_class() -> type[ZeroRedundancyOptimizer]:
    """torch's ZeroRedundancyOptimizer, imported here (after the group exists) without it keeping the group.

    The module's ``_broadcast_object`` takes ``group=dist.group.WORLD`` as a default, evaluated at
    import: imported while a group exists, the function holds that group for the life of the
    process, and its gloo threads, alive past destroy_process_group, crash the exit with SIGABRT
    (pytorch/pytorch#190489). ``None`` is the default group to torch.distributed as well, looked
    up when called; every caller in torch passes the group anyway.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer, zero_redundancy_optimizer

    function = zero_redundancy_optimizer._broadcast_object  # type: ignore[attr-defined]  # private, not in stubs
    if function.__defaults__ is not None:
        function.__defaults__ = tuple(
            None if isinstance(value, dist.ProcessGroup) else value for value in function.__defaults__
        )
    return ZeroRedundancyOptimizer


@contextlib.contextmanager
def _without_empty_groups(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Hide parameter groups with no parameters (a ZeRO-1 rank can own none of a group's), which
    torch's flattened optimizer state cannot describe, while the state is loaded."""
    groups = list(optimizer.param_groups)
    if all(group["params"] for group in groups):
        yield
        return
    optimizer.param_groups = [group for group in groups if group["params"]]
    try:
        yield
    finally:
        loaded = iter(optimizer.param_groups)
        optimizer.param_groups = [next(loaded) if group["params"] else group for group in groups]
