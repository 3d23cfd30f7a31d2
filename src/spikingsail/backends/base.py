"""The contract between the engine and a parallelism backend.

The engine owns the training loop's bookkeeping (micro-steps, counters, checkpoints, data); a
backend owns what differs between DDP, ZeRO, FSDP, DeepSpeed and Horovod: how processes are
joined, how the model and optimizer are wrapped, how gradient synchronisation is deferred on
micro-steps that are not an accumulation boundary, and how backward and the optimizer step run.
As in Lightning Fabric's Strategy → Precision split, the default ``backward`` and
``optimizer_step`` delegate loss scaling and unscaling to the backend's ``Precision``; a backend
whose library runs the step itself (DeepSpeed) overrides them. The engine never asks a backend's
name, and never branches on it: it calls these methods.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from spikingsail.config.compiling import CompileConfig
from spikingsail.config.schema import SailConfig
from spikingsail.environments import RankInfo
from spikingsail.optim.optimizers import build_optimizer
from spikingsail.optim.rebind import rebind_scheduler
from spikingsail.optim.schedulers import build_scheduler
from spikingsail.precision import Precision, select_precision


@dataclass(frozen=True, slots=True)
class DataParallel:
    """A process's place among the model's data-parallel replicas: what the loader shards by, what
    the batch sizes count, what the batch split and replica groups divide among."""

    rank: int
    """This process's replica: processes of one replica (a tensor-parallel group) have the same."""
    size: int
    """How many replicas split each global batch."""


class Backend(ABC):
    name: ClassVar[str]
    reads_deepspeed_config: ClassVar[bool] = False
    """DeepSpeed reads the config: every DeepSpeed key takes effect, and DeepSpeed's config class
    checks the keys SpikingSail does not read (``library_keys``). Else those keys only warn."""
    max_zero_stage: ClassVar[int] = 0
    """The highest ``zero_optimization.stage`` this backend implements."""
    honours_zero_options: ClassVar[bool] = False
    """Whether the ``zero_optimization`` keys besides ``stage`` (offload, buckets, …) take effect."""
    balances: ClassVar[bool] = True
    """Whether ranks may take unequal micro-batches (``sail.balance``): the backend averages
    gradients over ranks, which the engine's per-rank loss weights turn into the global mean."""
    measures_balance: ClassVar[bool] = True
    """Whether ``sail.balance: auto`` can time this backend's ranks: they compute forward and
    backward without waiting for each other until the gradient reduction at the end."""
    checkpoint_format: ClassVar[str] = "dcp"
    """How model and optimizer state is written; checkpoints load only into the same format."""
    replica_groups: ClassVar[bool] = False
    """Whether its gradients all-reduce across replica groups through torchft (``--ft-replicas``)."""

    @classmethod
    def replica_refusal(cls, config: SailConfig) -> tuple[str, str, str] | None:
        """What of ``config`` replica groups of this backend cannot keep exact (what, why, fix), if anything."""
        return None

    @classmethod
    def checked_by_deepspeed(cls) -> frozenset[str]:
        """The sections of SpikingSail's table whose keys it does not read DeepSpeed checks itself
        (``library_keys``): here ``zero_optimization``, of which this backend reads only ``stage``."""
        return frozenset({"zero_optimization"})

    @classmethod
    def library_keys(cls, config: SailConfig) -> frozenset[str] | None:
        """The top-level keys of the user's file outside SpikingSail's table that the installed
        DeepSpeed reads, asked of DeepSpeed itself (which refuses the keys it removed and checks
        the ``zero_optimization`` options); None where DeepSpeed does not import here, and then the
        options are checked against ``config/zero.py``'s table. This backend acts on none of them
        (the engine warns)."""
        from spikingsail.backends import deepspeed_keys
        from spikingsail.config.parse import TOP_LEVEL_KEYS
        from spikingsail.config.zero import build_zero

        raw = config.raw
        handed = {
            k: v for k, v in raw.items() if k not in TOP_LEVEL_KEYS and k not in config.backend_sections
        }
        if config.zero_optimization.options:  # the section as written, less its "auto" values
            handed["zero_optimization"] = raw["zero_optimization"]
        if not handed:
            return frozenset()
        known = deepspeed_keys.read({**handed, "train_micro_batch_size_per_gpu": 1}, 1, config.source)
        if known is None and "zero_optimization" in handed:
            build_zero(handed["zero_optimization"], config.source)  # no DeepSpeed here to ask
        return known

    @classmethod
    def data_parallel_size(cls, world_size: int, sections: dict[str, Any]) -> int:
        """How many data-parallel replicas ``world_size`` processes make (``sections``: the
        backends' config sections that were given). Every process is a replica of its own, unless
        a backend splits the model itself over several (tensor parallelism)."""
        return world_size

    @property
    def data_parallel(self) -> DataParallel:
        """This process's place among the data-parallel replicas (``data_parallel_size``'s)."""
        return DataParallel(self.rank_info.rank, self.rank_info.world_size)

    def __init__(self, config: SailConfig, rank_info: RankInfo) -> None:
        self.config = config
        self.rank_info = rank_info
        self.device = torch.device("cpu")
        self.precision = Precision(self.device)
        self.rank_buffers = False
        """True where each rank keeps its own buffers between the points that make them rank 0's
        (DDP without a broadcast at every forward): a checkpoint then also holds each rank's own
        (``rank_buffers/rankR.pt``), and a resume on as many ranks gives each rank its own back."""
        self.trained: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None
        """The model and the optimizer that ``setup_module_and_optimizer`` set up: the state that
        ``save_state`` writes and ``load_state`` reads."""

    @abstractmethod
    def setup(self) -> torch.device:
        """Join the process group (if any) and return the device this rank computes on."""

    @abstractmethod
    def wrap(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Wrap the (already placed) model and its optimizer for data-parallel training."""

    # -- the training step ------------------------------------------------------------------------

    def select_precision(self) -> Precision:
        """Choose (after ``setup``, on its device) and keep the precision this backend trains with:
        the config's fp16 loss scaling or bf16/fp16 autocast."""
        self.precision = select_precision(self.config.fp16, self.config.bf16, self.device)
        return self.precision

    def setup_module_and_optimizer(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        """Wrap model, optimizer and scheduler; the optimizer and scheduler come from the config when
        not given. Returns the module to call, the optimizer to step and the scheduler to step."""
        config = self.config
        if optimizer is None:
            assert config.optimizer is not None  # the engine checked that one of them is given
            optimizer = build_optimizer(config.optimizer, model.parameters(), config.source)
        wrapped, stepped = self.wrap(model, optimizer)
        self.trained = model, stepped
        if lr_scheduler is not None and stepped is not optimizer:
            rebind_scheduler(lr_scheduler, optimizer, stepped, self.name)
        if lr_scheduler is None and config.scheduler is not None:
            lr_scheduler = build_scheduler(config.scheduler, stepped, config.source)
        return wrapped, stepped, lr_scheduler

    compiles_forward_only: ClassVar[bool] = False
    """Compile each target's ``forward`` alone, not its hooks with it (``backends/compiling.py``)."""

    def compile_targets(self, wrapped: torch.nn.Module, model: torch.nn.Module) -> list[torch.nn.Module]:
        """What ``torch.compile`` compiles when ``compile.modules`` names nothing: the module the
        engine calls (``wrapped``; ``model`` is the user's model inside it)."""
        return [wrapped]

    def compile(self, wrapped: torch.nn.Module, model: torch.nn.Module, settings: CompileConfig) -> None:
        """Compile in place what ``settings`` says (``backends/compiling.py``), after ``wrap``."""
        from spikingsail.backends.compiling import compile_in_place, compile_kwargs, named_modules

        where = self.config.source
        kwargs = compile_kwargs(settings, where)
        if settings.modules:
            targets = named_modules(model, settings.modules, where)
        else:
            targets = self.compile_targets(wrapped, model)
        compile_in_place(targets, kwargs, where, forward_only=self.compiles_forward_only)

    def direct_step(self) -> bool:
        """Whether at this config the step needs nothing of the backend around the model's own calls:
        the backend's forward, backward and step are the defaults, full fp32 (no autocast, no loss
        scale), no clipping, and every forward synchronises its backward (no accumulation). The engine
        then calls ``model(...)``, ``loss.backward()``, ``optimizer.step()`` itself."""
        cls, config = type(self), self.config
        return (
            config.gradient_accumulation_steps == 1
            and config.gradient_clipping == 0
            and type(self.precision) is Precision
            and all(getattr(cls, name) is getattr(Backend, name)
                    for name in ("prepare_inputs", "backward", "step", "optimizer_step"))
        )  # fmt: skip

    def prepare_inputs(self, inputs: Any) -> Any:
        """Adapt a forward's arguments to the wrapped module (dtype of a half-precision model)."""
        return inputs

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` averaged over the accumulation window (the precision scales it)."""
        accumulation = self.config.gradient_accumulation_steps
        self.precision.backward(loss / accumulation if accumulation > 1 else loss)

    def step(self, optimizer: torch.optim.Optimizer, lr_scheduler: Any, *, boundary: bool) -> bool:
        """End a micro-step; on an accumulation boundary, step the optimizer. True when that step
        was skipped (fp16 overflow)."""
        return self.optimizer_step(optimizer, lr_scheduler) if boundary else False

    def optimizer_step(self, optimizer: torch.optim.Optimizer, lr_scheduler: Any) -> bool:
        """Unscale the gradients (skip the step when they overflowed), clip, step the optimizer and
        the scheduler, update the loss scale and zero the gradients. True when skipped."""
        overflow = self.precision.unscale_(optimizer)
        if not overflow:
            if self.config.gradient_clipping > 0:
                parameters = (p for group in optimizer.param_groups for p in group["params"])
                self.clip_grad_norm_(parameters, self.config.gradient_clipping)
            optimizer.step()
            if lr_scheduler is not None:
                lr_scheduler.step()
        self.precision.update(overflow)
        optimizer.zero_grad(set_to_none=True)
        return overflow

    @property
    def loss_scale(self) -> float:
        return self.precision.loss_scale

    def sync_counters(self, micro_steps: int, global_steps: int, global_samples: int, skipped: int) -> None:
        """Bring the backend's own step counters to the engine's (after a checkpoint load)."""

    # -- model and optimizer state -----------------------------------------------------------------

    def check_can_save(self, mid_window: bool) -> None:
        """Raise ``CheckpointError`` before anything is written when this save cannot be exact."""

    def check_can_load(self, directory: Path, saved_world_size: int) -> None:
        """Raise ``CheckpointError`` before anything is read when this backend cannot resume a
        checkpoint that ``saved_world_size`` processes wrote."""

    def checkpointed(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The model and optimizer whose state ``save_state`` writes and ``load_state`` reads: those
        ``setup_module_and_optimizer`` set up (a backend whose optimizer wraps the one that holds
        the state gives the inner one)."""
        if self.trained is None:
            raise RuntimeError(
                f"backend {self.name}: model and optimizer state before setup_module_and_optimizer"
            )
        return self.trained

    def save_state(
        self, directory: Path, group: dist.ProcessGroup | None, background: bool
    ) -> Future[Any] | None:
        """Write model and optimizer state into ``directory`` (collective). In the background,
        return a future that completes when the files are written; otherwise None.

        Buffers that each rank updates for itself (batch-norm running statistics without
        SyncBatchNorm) differ between ranks, and DCP writes one copy of a replicated tensor from
        whichever rank it picks: rank 0's are given to every rank first, so the checkpoint holds
        them and every rank continues from them, in the run that saved as in one that resumes
        (DDP's broadcast before every forward does the same; DeepSpeed saves rank 0's). A backend
        with ``rank_buffers`` puts rank 0's into the state instead and leaves each rank its own."""
        from spikingsail.checkpoint import dcp_io  # imported when first used: it takes a second

        state = self.state_to_save()
        if background:
            return dcp_io.async_save(state, directory, group)
        dcp_io.save(state, directory, group)
        return None

    def state_to_save(self) -> dict[str, Any]:
        """The state DCP writes, every rank's buffers made rank 0's first (collective)."""
        module, optimizer = self.checkpointed()
        if dist.is_initialized() and dist.get_world_size() > 1:
            with torch.no_grad():
                for buffer in persistent_buffers(module):
                    dist.broadcast(buffer, src=0)
        from spikingsail.checkpoint import dcp_io

        return dcp_io.state_to_save(module, optimizer)

    def load_state(self, directory: Path, group: dist.ProcessGroup | None, *, with_optimizer: bool) -> None:
        """Read what ``save_state`` wrote (collective); without the optimizer: the weights only."""
        from spikingsail.checkpoint import dcp_io

        module, optimizer = self.checkpointed()
        dcp_io.load(module, optimizer if with_optimizer else None, directory, group)

    def consolidated_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state dict in fp32 where it trains in fp32 (collective: every rank calls
        it; rank 0 gets the tensors on the CPU, the other ranks may get an empty dict). Sharded
        parameters (FSDP) are gathered."""
        from spikingsail.checkpoint import dcp_io

        return dcp_io.full_model_state(module)

    def live_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """What a healing replica group's counterpart rank takes from this one (``load_live_state``):
        ``{"model": ..., "optimizer": ...}``, this rank's own parts of them."""
        return {"model": module.state_dict(), "optimizer": optimizer.state_dict()}

    def load_live_state(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """A healing replica group's copy of another group's ``state["model"]`` and
        ``state["optimizer"]``: this rank's local parts, as the counterpart rank of that group holds them."""
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

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


def persistent_buffers(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The buffers a state_dict holds (not, e.g., snntorch's per-rank membrane potentials)."""
    for m in module.modules():
        for name, buffer in m._buffers.items():
            if buffer is not None and name not in m._non_persistent_buffers_set:
                yield buffer
