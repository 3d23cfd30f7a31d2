"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from spikingsail.backends.process_group import ProcessGroupBackend
from spikingsail.config.schema import SailConfig
from spikingsail.environments import RankInfo


class DDPBackend(ProcessGroupBackend):
    name = "ddp"

    def __init__(self, config: SailConfig, rank_info: RankInfo) -> None:
        super().__init__(config, rank_info)
        self.ddp: DistributedDataParallel | None = None

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
        return self.ddp, optimizer

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        # DDP decides at forward time whether the following backward all-reduces, so the
        # engine enters this context around the forward of every micro-step.
        if self.ddp is None or enabled:
            return contextlib.nullcontext()
        return self.ddp.no_sync()

    def teardown(self) -> None:
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
