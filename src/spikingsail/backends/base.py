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
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from spikingsail.checkpoint import dcp_io
from spikingsail.config.schema import SailConfig
from spikingsail.environments import RankInfo


class Backend(ABC):
    name: ClassVar[str]
    honoured_deepspeed_keys: ClassVar[frozenset[str]] = frozenset()
    """DeepSpeed keys outside SpikingSail's core that this backend acts on (others only warn)."""
    max_zero_stage: ClassVar[int] = 0
    """The highest ``zero_optimization.stage`` this backend implements."""
    owns_step: ClassVar[bool] = False
    """True when the backend's own engine runs backward, the optimizer step, loss scaling,
    clipping and the scheduler (DeepSpeed); the engine then calls ``backward``/``step`` here."""
    builds_from_config: ClassVar[bool] = False
    """True when the backend builds the config's optimizer and scheduler itself."""
    checkpoint_format: ClassVar[str] = "dcp"
    """How model and optimizer state is written; checkpoints load only into the same format."""

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

    # -- for backends that own the step (``owns_step``) ------------------------------------------

    def wrap_owning(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        """Wrap model, optimizer and scheduler (either may come from the config instead)."""
        raise NotImplementedError(f"backend {self.name} does not own the training step")

    def prepare_inputs(self, inputs: Any) -> Any:
        """Adapt a forward's arguments to the wrapped module (dtype of a half-precision model)."""
        return inputs

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError(f"backend {self.name} does not own the training step")

    def step(self) -> bool:
        """End a micro-step; on a boundary, step the optimizer. True when the step was skipped."""
        raise NotImplementedError(f"backend {self.name} does not own the training step")

    @property
    def loss_scale(self) -> float:
        return 1.0

    def sync_counters(self, micro_steps: int, global_steps: int, global_samples: int, skipped: int) -> None:
        """Bring the backend's own step counters to the engine's (after a checkpoint load)."""

    # -- model and optimizer state -----------------------------------------------------------------

    def check_can_save(self, mid_window: bool) -> None:
        """Raise ``CheckpointError`` before anything is written when this save cannot be exact."""

    def check_can_load(self, directory: Path, saved_world_size: int) -> None:
        """Raise ``CheckpointError`` before anything is read when this backend cannot resume a
        checkpoint that ``saved_world_size`` processes wrote."""

    def save_state(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        directory: Path,
        group: dist.ProcessGroup | None,
        background: bool,
    ) -> Future[Any] | None:
        """Write model and optimizer state into ``directory`` (collective). In the background,
        return a future that completes when the files are written; otherwise None."""
        state = dcp_io.state_to_save(module, optimizer)
        if background:
            return dcp_io.async_save(state, directory, group)
        dcp_io.save(state, directory, group)
        return None

    def load_state(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        directory: Path,
        group: dist.ProcessGroup | None,
    ) -> None:
        """Read what ``save_state`` wrote (collective); ``optimizer`` None loads weights only."""
        dcp_io.load(module, optimizer, directory, group)

    def own_state_files(self, directory: Path, rank: int) -> list[Path]:
        """The files of ``directory`` this rank wrote (it seals them; rank 0 seals the rest)."""
        return list(directory.glob(f"__{rank}_*.distcp"))

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        """Entered around every forward. With ``enabled`` False the backward that follows keeps its
        gradients local (accumulated for the boundary's reduction); a backend whose library reads
        the setting during backward (FSDP2) sets it here for the whole micro-step."""
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
