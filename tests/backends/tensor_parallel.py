"""A tensor-parallel backend in one file, as a user would add one: torch's own tensor parallelism
(``parallelize_module``: the first linear layer split by columns, the last by rows) over every
process of the job, which together make one data-parallel replica. It is registered with one line
(``backends._REGISTRY``) by the test that uses it; the engine needs nothing else."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from spikingsail.backends.base import DataParallel
from spikingsail.backends.process_group import ProcessGroupBackend

REGISTRY_LINE = ("tensor-parallel", "tests.backends.tensor_parallel:TensorParallelBackend")


class TensorParallelBackend(ProcessGroupBackend):
    name = "tensor-parallel"
    balances = False  # the processes of a replica compute one batch together
    measures_balance = False

    @classmethod
    def data_parallel_size(cls, world_size: int, sections: dict[str, Any]) -> int:
        return 1

    @property
    def data_parallel(self) -> DataParallel:
        return DataParallel(rank=0, size=1)

    def wrap(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        if not self.rank_info.distributed:
            return model, optimizer
        with torch.no_grad():  # every process starts from rank 0's weights, each keeping its slice
            for tensor in (*model.parameters(), *model.buffers()):
                dist.broadcast(tensor, src=0)
        names = {id(p): n for n, p in model.named_parameters()}
        mesh = init_device_mesh(self.device.type, (self.rank_info.world_size,))
        last = str(len(model) - 1)  # type: ignore[arg-type]
        parallelize_module(model, mesh, {"0": ColwiseParallel(), last: RowwiseParallel()})
        sliced = dict(model.named_parameters())
        for group in optimizer.param_groups:  # no state yet: pointing it at the slices is all
            group["params"] = [sliced[names[id(p)]] for p in group["params"]]
        return model, optimizer
