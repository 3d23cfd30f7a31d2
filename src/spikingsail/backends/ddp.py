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
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from spikingsail.backends.process_group import ProcessGroupBackend
from spikingsail.config.schema import SailConfig
from spikingsail.environments import RankInfo
from spikingsail.errors import BackendError

log = logging.getLogger(__name__)


class DDPBackend(ProcessGroupBackend):
    name = "ddp"
    max_zero_stage = 1

    def __init__(self, config: SailConfig, rank_info: RankInfo) -> None:
        super().__init__(config, rank_info)
        self.ddp: DistributedDataParallel | None = None
        self.zero: ZeroRedundancyOptimizer | None = None

    def wrap(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        if not self.rank_info.distributed:
            return model, optimizer
        device = next(model.parameters()).device
        self.ddp = DistributedDataParallel(
            model,
            device_ids=[device] if device.type == "cuda" else None,
            find_unused_parameters=self.config.sail.find_unused_parameters,
        )
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

    def save_state(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        directory: Path,
        group: dist.ProcessGroup | None,
        background: bool,
    ) -> Future[Any] | None:
        # the base gives every rank rank 0's buffers first, as DDP does at the next forward
        return super().save_state(module, self._local(optimizer), directory, group, background)

    def load_state(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        directory: Path,
        group: dist.ProcessGroup | None,
    ) -> None:
        if optimizer is None:
            super().load_state(module, None, directory, group)
            return
        local = self._local(optimizer)
        with _without_empty_groups(local):
            super().load_state(module, local, directory, group)

    def _local(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.zero is not None and optimizer is self.zero:
            local: torch.optim.Optimizer = self.zero.optim
            return local
        return optimizer

    def teardown(self) -> None:
        self.zero = None
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
    return ZeroRedundancyOptimizer(optimizer.param_groups, optimizer_class=cls, **defaults)


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
