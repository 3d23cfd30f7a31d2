"""The contract between the engine and a parallelism backend.

The engine owns the training loop's bookkeeping (micro-steps, loss scaling, clipping, the
scheduler); a backend owns what differs between DDP, ZeRO, FSDP and Horovod: how processes are
joined, how the model and optimizer are wrapped, and how gradient synchronisation is deferred on
micro-steps that are not an accumulation boundary. The engine never asks a backend's name — it
asks what the backend declares.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import ClassVar

import torch
import torch.distributed as dist

from spikingsail.config.schema import SailConfig
from spikingsail.environments import RankInfo


class Backend(ABC):
    name: ClassVar[str]
    honoured_deepspeed_keys: ClassVar[frozenset[str]] = frozenset()
    """DeepSpeed keys outside SpikingSail's core that this backend acts on (others only warn)."""
    max_zero_stage: ClassVar[int] = 0
    """The highest ``zero_optimization.stage`` this backend implements."""

    def __init__(self, config: SailConfig, rank_info: RankInfo) -> None:
        self.config = config
        self.rank_info = rank_info
        self.device = torch.device("cpu")

    @abstractmethod
    def setup(self) -> torch.device:
        """Join the process group (if any) and return the device this rank computes on."""

    @abstractmethod
    def wrap(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Wrap the (already placed) model and its optimizer for data-parallel training."""

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        """Context for a forward/backward pair; with ``enabled`` False gradients stay local."""
        return contextlib.nullcontext()

    def clip_grad_norm_(self, parameters: Iterator[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, for metrics; returns a new tensor on the input's device."""
        if not dist.is_initialized():
            return tensor.clone()
        reduced = tensor.to(self.device, copy=True)
        dist.all_reduce(reduced)
        return reduced.to(tensor.device)

    def teardown(self) -> None:
        """Release what ``setup`` acquired."""
