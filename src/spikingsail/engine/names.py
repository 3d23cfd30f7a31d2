"""The engine's calls under DeepSpeed's names: its counters and batch sizes, and its checkpoints
(the ``Checkpointer``'s), as a DeepSpeed engine's; ``Engine`` takes them from ``DeepSpeedNames``."""

from __future__ import annotations

import dataclasses
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from spikingsail.backends.base import Backend
from spikingsail.checkpoint.checkpointer import Checkpointer
from spikingsail.config.schema import SailConfig
from spikingsail.engine import features
from spikingsail.engine.compiling import CompileWatch
from spikingsail.engine.hooks import StepHooks
from spikingsail.engine.state import StepCounters
from spikingsail.environments import RankInfo
from spikingsail.errors import ConfigError
from spikingsail.monitor.heartbeat import Heartbeat, NoHeartbeat
from spikingsail.snn.support import SpikingSupport

log = logging.getLogger(__name__)


class DeepSpeedNames:
    """DeepSpeed's accessors and checkpoint calls, on the engine's parts."""

    config: SailConfig
    counters: StepCounters
    backend: Backend
    optimizer: torch.optim.Optimizer
    rank_info: RankInfo
    checkpointer: Checkpointer
    hooks: StepHooks
    snn: SpikingSupport
    module: torch.nn.Module
    wrapped_module: torch.nn.Module
    compiled: CompileWatch | None
    heartbeat: Heartbeat | NoHeartbeat
    monitor: Any
    _closing: ExitStack

    @property
    def micro_steps(self) -> int:
        """Micro-steps (forward and backward passes) taken so far."""
        return self.counters.micro_steps

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken so far (skipped fp16 overflow steps included)."""
        return self.counters.global_steps

    @property
    def global_samples(self) -> int:
        """Samples trained on so far, over all ranks."""
        return self.counters.global_samples

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because fp16 gradients overflowed."""
        return self.counters.skipped_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` ends an accumulation window and steps the optimizer."""
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step (the config's ``gradient_accumulation_steps``)."""
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        """The global batch per optimizer step (the config's ``train_batch_size``)."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """The batch each process takes per micro-step (the config's ``train_micro_batch_size_per_gpu``)."""
        return self.config.train_micro_batch_size_per_gpu

    def get_lr(self) -> list[float]:
        """The learning rate of every parameter group of the optimizer."""
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self.backend.loss_scale

    @property
    def rank(self) -> int:
        """This process's rank in the job."""
        return self.rank_info.rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self.rank_info.local_rank

    @property
    def world_size(self) -> int:
        """The number of processes in the job."""
        return self.rank_info.world_size

    # -- checkpoints (the checkpointer's) ------------------------------------------------------

    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        *,
        async_save: bool | None = None,
    ) -> str:
        """Save everything needed to continue exactly here (DeepSpeed's name and arguments).

        Every rank must call it. ``tag`` defaults to ``global_step{N}``; ``client_state`` may hold
        tensors, numbers, strings, bools, None and lists/tuples/dicts of them. With ``async_save``
        (default: the config's ``checkpoint.async_save``) the state is copied to host memory and
        written in the background; the checkpoint appears (and ``latest`` moves) when the write
        completes. A save waits for the previous background save first; so do loading and close().
        """
        path = self.checkpointer.save(save_dir, tag, client_state, async_save=async_save)
        self._follow_checkpointer()
        return path

    def _follow_checkpointer(self) -> None:
        """The checkpointer takes part in the steps once it has something to do at them."""
        if self.checkpointer.wants_steps and self.checkpointer not in self.hooks:
            self.hooks.add(self.checkpointer)

    def wait_for_checkpoint(self) -> None:
        """Block until a background save has been written and committed. If it failed: raise its
        error on every rank — or, for a periodic save under checkpoint.on_error "continue", warn."""
        self.checkpointer.wait()

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str, dict[str, Any]]:
        """Restore a checkpoint; returns ``(path, client_state)``. ``tag`` None means the latest good one.

        A resume continues the saved run: settings that shape the training must match the saved
        ones (the split of train_batch_size over processes and accumulation may change on a step
        boundary). ``load_module_only`` (DeepSpeed's name) takes the weights alone, for a new run.
        """
        path, client_state = self.checkpointer.load(
            load_dir, tag, with_optimizer=load_optimizer_states, module_only=load_module_only
        )
        if not load_module_only:
            self.backend.sync_counters(
                self.micro_steps, self.global_steps, self.global_samples, self.skipped_steps
            )
            self.snn.after_load()
            log.info("resumed from %s at step %d", path, self.global_steps)
        return path, client_state

    def compile(
        self,
        backend: str | None = None,
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """DeepSpeed's ``engine.compile()``: ``torch.compile`` the model now, as ``"compile":
        {"enabled": true}`` does at start, with ``backend`` and ``compile_kwargs`` in place of the
        section's ``backend`` and ``kwargs`` (its other keys apply); recompilations are counted from
        here. Once compiled, a call does nothing, as DeepSpeed's."""
        if schedule is not None or compiled_autograd_enabled:
            raise ConfigError(
                "engine.compile(): schedule and compiled_autograd_enabled are not supported",
                "they are DeepCompile's and compiled autograd's settings, which only DeepSpeed's engine runs",
                'drop them; for DeepCompile use the deepspeed backend with "compile": {"enabled": true, '
                '"deepcompile": true, ...} in the config',
            )
        if self.compiled is not None:
            return
        section = self.config.compile
        settings = dataclasses.replace(
            section,
            enabled=True,
            backend=section.backend if backend is None else backend,
            kwargs=section.kwargs if compile_kwargs is None else dict(compile_kwargs),
        )
        self.compiled = features.compiled(
            settings, self.config.sail.hang_timeout_seconds, self.backend, self.wrapped_module, self.module,
            self.counters, self.monitor.event, self.rank_info.rank, self.heartbeat, self._closing,
        )  # fmt: skip

    @property
    def is_compiled(self) -> bool:
        """Whether the model is compiled (DeepSpeed's name)."""
        return self.compiled is not None
