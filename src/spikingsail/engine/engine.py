"""The training engine: ``loss = engine(batch); engine.backward(loss); engine.step()``.

It keeps DeepSpeed's bookkeeping — ``micro_steps`` counts every ``step()`` call, an optimizer step
happens on accumulation boundaries only and increments ``global_steps`` — and delegates all
parallelism to a ``Backend``, checkpoints to a ``Checkpointer``, the split of each batch to a
``BatchSplit`` (``engine/split.py``), and everything else a step may do to the features that are on,
through its step hooks (``engine/hooks.py``).
"""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import os
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from spikingsail.backends.base import Backend
from spikingsail.checkpoint.checkpointer import Checkpointer
from spikingsail.checkpoint.compatibility import as_saved
from spikingsail.checkpoint.engine_state import TrainingState, merged_state_dict
from spikingsail.config.schema import SailConfig
from spikingsail.data.loader import ShardedLoader
from spikingsail.engine import features
from spikingsail.engine.balance import Balancer
from spikingsail.engine.hooks import StepHooks, StepNotes
from spikingsail.engine.names import DeepSpeedNames
from spikingsail.engine.replicas import ReplicaEnv, ReplicaGroups
from spikingsail.engine.setup import (
    check_optimizer_source,
    keep_neuron_state_per_rank,
    passed,
    seed_everything,
    use_deterministic_algorithms,
)
from spikingsail.engine.split import EqualSplit, ReplicaSplit, balanced_split
from spikingsail.engine.state import Entry, LoaderPositions, OptimizerHyperparameters, StepCounters
from spikingsail.environments import RankInfo
from spikingsail.errors import CheckpointError
from spikingsail.monitor.hangwatch import COLLECTIVE
from spikingsail.monitor.heartbeat import NoHeartbeat
from spikingsail.monitor.ledger import QuorumLedger
from spikingsail.precision import Precision
from spikingsail.snn.chunking import time_chunked
from spikingsail.snn.encoding import encode
from spikingsail.snn.support import SpikingSupport
from spikingsail.snn.syncbn import convert_sync_batchnorm
from spikingsail.tensors import map_tensors

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

log = logging.getLogger(__name__)

LRScheduler = Any  # torch LRScheduler or one of spikingsail.optim.schedulers: anything with step()


class Engine(DeepSpeedNames):
    """The training loop's one object, what ``SpikingSail(args, model, optimizer).run()`` returns: the
    model wrapped by the chosen backend, called as ``engine(batch)``, with ``backward``, ``step``, a
    sharded ``dataloader``, checkpoints and the trained model out; the same calls on every backend."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        config: SailConfig,
        rank_info: RankInfo,
        backend: Backend,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> None:
        self.config, self.rank_info, self.backend = config, rank_info, backend
        given = passed(optimizer), passed(lr_scheduler)
        check_optimizer_source(config.optimizer, config.scheduler, config.source, given)
        if config.sail.seed is not None:
            seed_everything(config.sail.seed)
        if config.sail.deterministic:
            use_deterministic_algorithms()
        self.device = backend.setup()
        self._closing = ExitStack()  # what close() unwinds, last made first
        self._closing.callback(backend.teardown)
        self._closed = False
        try:
            self._build(model, optimizer, lr_scheduler)
        except BaseException:  # a failed start leaves nothing up: no process group, watch or lock
            self._closed = True
            self._closing.close()
            raise
        atexit.register(self._close_at_exit)
        # What exists now lives as long as the job: frozen, no collection scans it (all ranks wait for one).
        gc.collect()
        gc.freeze()
        log.info("engine ready: rank %d of %d on %s", rank_info.rank, rank_info.world_size, self.device)

    def _build(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: LRScheduler | None,
    ) -> None:
        config, rank_info, backend, closing = self.config, self.rank_info, self.backend, self._closing
        self.module = model.to(self.device)
        self.snn = SpikingSupport.for_model(config.snn, self.module, config.source, self.device)
        if config.snn.sync_batchnorm and rank_info.distributed:
            self.module = convert_sync_batchnorm(self.module)  # keeps the Parameter objects
        if config.snn.time_chunk != 0:  # keeps the Parameter objects and the state_dict keys
            adapter = self.snn.adapter.name if self.snn.adapter is not None else None
            self.module = time_chunked(self.module, config.snn, adapter, self.snn.multi_step, config.source)
        keep_neuron_state_per_rank(self.module, self.snn)
        self.precision: Precision = backend.select_precision()
        self.wrapped_module, self.optimizer, self.lr_scheduler = backend.setup_module_and_optimizer(
            self.module, optimizer, lr_scheduler
        )
        self.counters = StepCounters(accumulation=config.gradient_accumulation_steps)
        self.loaders = LoaderPositions()
        self.hooks, self._notes = StepHooks(), StepNotes()
        # Inputs already on the CPU need no move; skipping the walk keeps tiny steps cheap.
        self._move_inputs = config.sail.move_inputs_to_device and self.device.type != "cpu"
        self._direct = backend.direct_step() and not self._move_inputs
        """The step is the model's own calls: nothing of the backend or precision around them."""
        self.split: EqualSplit = balanced_split(
            config, self.counters, self.module, self.device, rank_info, backend
        )
        closing.callback(self.split.close)
        # step hooks: the first added enters first and leaves last (the heartbeat's record holds the rest)
        sail = config.sail
        self.heartbeat = features.hang_watch(sail, rank_info, self.counters, self.log_dir, closing)
        self.monitor = features.monitor(config, rank_info, self.log_dir, closing)
        self.monitor.attach(
            lr=lambda: float(self.optimizer.param_groups[0]["lr"]), loss_scale=lambda: self.loss_scale
        )
        self.compiled = features.compiled(config.compile, sail.hang_timeout_seconds, backend, self.wrapped_module,
                                          self.module, self.counters, self.monitor.event, rank_info.rank,
                                          self.heartbeat, closing)  # fmt: skip
        overflows = features.Overflows(lambda: self.loss_scale)
        stragglers = features.straggler_watch(sail, rank_info, self.module, self.device, backend, closing)
        replica_env = ReplicaEnv.from_env()
        group = replica_env.group if replica_env is not None else None
        self.ledger = features.ledger(sail, rank_info, backend, self.log_dir, replica_env, self.counters,
                                      closing)  # fmt: skip
        for feature, on in ((self.heartbeat, not isinstance(self.heartbeat, NoHeartbeat)),
                            (self.monitor, self.monitor.enabled), (self.snn, self.snn.active),
                            (self.split, True), (stragglers, stragglers is not None),
                            (overflows, config.fp16.enabled), (self.ledger, self.ledger is not None)):  # fmt: skip
            if on:
                self.hooks.add(feature)
        self.checkpointer = Checkpointer.start(
            config.checkpoint, rank_info=rank_info, device=self.device, state=self._training_state,
            steps=self.counters, beat=self.heartbeat, report=self.monitor.event,
            replica_group=group, close_job=self.close,
        )  # fmt: skip
        closing.callback(self.checkpointer.close)
        self._follow_checkpointer()
        if replica_env is not None:  # torchft's manager, no quorum yet (join_replica_groups)
            self.split = ReplicaSplit(config, self.counters, replica_env, rank_info, self.device, self.module,
                                      self.optimizer, backend, (self.state_dict, self.load_state_dict))  # fmt: skip
            closing.callback(self.split.close)
            self.hooks.add(self.split)
            if self.ledger is not None:  # what a step takes, before the groups exchange its gradients
                self.hooks.add(QuorumLedger(self.ledger, self.split.quorum))
        self._backward: Callable[[torch.Tensor], None] = (
            torch.Tensor.backward if self._direct else backend.backward
        )

    # -- the training step -------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward (what ``engine(batch)`` calls), with the inputs moved to ``engine.device`` and the backend's precision and spiking-neuron handling around it."""
        for hook in self.hooks.forward_begin:
            hook()
        if self._direct:
            out = self.wrapped_module(*inputs, **kwargs)
        else:
            out = self._backend_forward(inputs, kwargs)
        for hook in self.hooks.forward_end:
            hook()
        return out

    __call__ = forward

    def _backend_forward(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._move_inputs:
            inputs, kwargs = map_tensors((inputs, kwargs), lambda t: t.to(self.device, non_blocking=True))
        sync = self.is_gradient_accumulation_boundary() or not torch.is_grad_enabled()
        inputs, kwargs = self.backend.prepare_inputs((inputs, kwargs))
        with self.backend.gradient_sync(sync), self.precision.autocast():
            return self.wrapped_module(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` averaged over the accumulation window (and scaled for fp16), weighed
        by its batch's share of the step where shares differ."""
        boundary = (self.counters.micro_steps + 1) % self.counters.accumulation == 0
        # its value, not its graph: the engine lives until the interpreter's exit (gc.freeze), and
        # nothing of a step's autograd graph should be left to free then
        self._notes.loss = loss.data
        for begin in self.hooks.backward_begin:
            begin(loss, boundary)
        self._backward(self.split.weigh(loss) if self.split.weighs else loss)
        for end in self.hooks.backward_end:
            end(boundary)

    def step(self) -> None:
        """End a micro-step; on an accumulation boundary, update the weights."""
        counters, hooks = self.counters, self.hooks
        boundary = (counters.micro_steps + 1) % counters.accumulation == 0
        for begin in hooks.step_begin:
            begin(boundary)
        if boundary:
            for vote in hooks.vote:
                if not vote():
                    return self._discard_step()
        if self._direct:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            skipped = False
        else:
            skipped = self.backend.step(self.optimizer, self.lr_scheduler, boundary=boundary)
        counters.micro_steps += 1
        if boundary:
            counters.skipped_steps += skipped
            counters.global_steps += 1
            counters.global_samples += self.config.train_batch_size
            notes = self._notes
            notes.step, notes.skipped = counters.global_steps, skipped
            for stepped in hooks.optimizer_end:
                stepped(notes)
            for period, due in hooks.period_end:
                if notes.step % period == 0:
                    due(notes)
        # after the counters moved on: a checkpoint saved here records the step as finished, or a
        # resume would take its first micro-step for the end of an accumulation window
        for end in hooks.step_end:
            end(boundary)
        return None

    def _discard_step(self) -> None:
        """The replica groups did not commit this step: forget its gradients and take it again
        (the engine's loader serves the same samples)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.counters.micro_steps = self.counters.global_steps * self.counters.accumulation
        log.warning("step %d not committed by the replica groups (a peer failed): taking it again",
                    self.counters.global_steps + 1)  # fmt: skip
        for forget in self.hooks.discarded:
            forget()
        for end in self.hooks.step_end:
            end(False)

    def join_replica_groups(self) -> None:
        """Take the first quorum of a job of replica groups (``initialize`` does, after a resume and
        before the script makes its loaders): a group behind the others heals here — torchft loads a
        live group's state into it — and takes part in their step."""
        self.split.join()

    @property
    def balancer(self) -> Balancer | None:
        """``sail.balance``'s current split and measurement (None when off)."""
        return self.split.balancer

    @property
    def replicas(self) -> ReplicaGroups | None:
        """This replica group's torchft manager and transport (None without ``--ft-replicas``)."""
        return self.split.replicas

    @functools.cached_property
    def log_dir(self) -> Path:
        """The run's directory (``sail.log_dir``; ``features.run_directory`` says where by default)."""
        return features.run_directory(self.config.sail)

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """The script's own scalars (``{"val/accuracy": 0.93}``; numbers or one-element tensors) at
        ``step`` (default: the optimizer steps so far), to the trackers and the metrics file. Rank 0
        writes; on the other ranks it does nothing (log what rank 0 knows, or all-reduce first)."""
        if not self.rank_info.is_rank_zero:
            return
        values = {str(k): float(v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
        self.monitor.log(values, self.global_steps if step is None else step)

    def train(self, mode: bool = True) -> Engine:
        """Put the model in training mode (or evaluation mode with ``mode=False``), as ``nn.Module.train``."""
        if mode != self.wrapped_module.training:
            self.snn.on_mode_change()
        self.wrapped_module.train(mode)
        return self

    def eval(self) -> Engine:
        """Put the model in evaluation mode, as ``nn.Module.eval``."""
        return self.train(False)

    # -- data and lifetime ---------------------------------------------------------------------

    def dataloader(
        self,
        dataset: Dataset[Any],
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        pad: bool = True,
        batch_size: int | None = None,
        seed: int | None = None,
        pin_memory: bool | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **loader_kwargs: Any,
    ) -> ShardedLoader:
        """This rank's shard of ``dataset`` in micro batches; the epoch advances on every full pass.

        ``pad=False`` (for evaluation) gives every sample to exactly one rank instead of repeating
        samples to even out the shards. Batches arrive on ``engine.device`` (labels too), unless
        ``sail.move_inputs_to_device`` is false. Called again with the same dataset object and the
        same arguments, it returns the loader it made before: a loop that asks for the loader every
        epoch goes on to the next epoch (a new shuffle) instead of repeating the first one.
        """
        arguments = dict(shuffle=shuffle, drop_last=drop_last, pad=pad, batch_size=batch_size, seed=seed,
                         pin_memory=pin_memory, collate_fn=collate_fn, **loader_kwargs)  # fmt: skip
        made = self.loaders.made_before(dataset, arguments)
        if made is not None:
            return made
        # the training loader (padded, at the configured micro-batch) takes its shares or its sampler
        # from the split, and reads its epochs in optimizer steps, the last one short on any split alike
        training = pad and batch_size is None
        seed = seed if seed is not None else (self.config.sail.seed or 0)
        replicated = (
            self.split.sampler(dataset, shuffle, seed, drop_last, loader_kwargs) if training else None
        )
        replica = self.backend.data_parallel  # the loader shards by data-parallel replica
        ledger = self.ledger if training else None
        loader = ShardedLoader(
            dataset,
            batch_size=batch_size or self.config.train_micro_batch_size_per_gpu,
            rank=replica.rank,
            world_size=replica.size,
            shuffle=shuffle,
            drop_last=drop_last,
            pad=pad,
            seed=seed,
            pin_memory=self.device.type == "cuda" if pin_memory is None else pin_memory,
            collate_fn=collate_fn,
            on_batch=self.snn.on_batch if self.snn.manages_state or self.config.snn.check_state else None,
            device=self.device if self._move_inputs else None,
            shares=self.split.shares() if training else None,
            accumulation=self.counters.accumulation if training and replicated is None else None,
            replicated=replicated,
            record=ledger.take if ledger is not None else None,
            **loader_kwargs,
        )
        if training:
            self.split.loader_made(loader)
        if ledger is not None:
            ledger.loader_made(len(loader.dataset), loader.epoch_samples(), self.config.train_batch_size)  # type: ignore[arg-type]
        self.loaders.add(loader, dataset, arguments)
        return loader

    def save_model(self, path: str | Path, *, dtype: torch.dtype = torch.float32) -> str | None:
        """Write the trained model as one consolidated state dict, loadable with
        ``model.load_state_dict`` with no SpikingSail, backend or process group.

        Every rank must call it; rank 0 writes ``path`` (``.safetensors``, or ``.pt`` / ``.pth`` /
        ``.bin`` for ``torch.save``) atomically and gets its path, the others None. Whatever the
        backend: FSDP shards and DeepSpeed ZeRO partitions are gathered, DeepSpeed's fp32 master
        weights taken where it keeps them. Floating tensors are written in ``dtype`` (float32; pass
        ``torch.bfloat16`` or ``torch.float16`` for the half-size file). Keys are the model's own
        (no ``module.`` prefix).
        """
        from spikingsail.checkpoint import export

        self.wait_for_checkpoint()
        return export.save_live_model(
            self._training_state(False), path, dtype, steps=self.counters, beat=self.heartbeat
        )

    # -- state -----------------------------------------------------------------------------------

    def state_parts(self, *, with_optimizer: bool = True) -> dict[str, Stateful]:
        """The engine's ``Stateful`` parts, in the order they are restored (the optimizer's settings
        before the scheduler's state, which may read them)."""
        optimizer = {"optimizer": OptimizerHyperparameters(self.optimizer)} if with_optimizer else {}
        return {"counters": self.counters, **optimizer, "lr_scheduler": Entry("lr_scheduler", self.lr_scheduler),
                "precision": Entry("precision", self.precision), "loaders": self.loaders,
                "balance": Entry("balance", self.split.balancer),
                "fault_tolerance": Entry("fault_tolerance", self.split.replicas),
                "ledger": Entry("ledger", self.ledger)}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Counters, optimizer settings, scheduler, loss scaler and data positions (not the model
        and optimizer tensors, which the backend saves)."""
        return merged_state_dict(self.state_parts())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict()`` returned: the model, optimizer and every stateful part of the engine."""
        for part in self.state_parts().values():
            part.load_state_dict(state_dict)

    def _training_state(self, with_optimizer: bool = True) -> TrainingState:
        optimizer = self.optimizer if with_optimizer else None
        states = self.state_parts(with_optimizer=with_optimizer)
        return TrainingState(module=self.module, optimizer=optimizer, backend=self.backend,
                             config=as_saved(self.config), keep_last=self.config.checkpoint.keep_last,
                             rank_info=self.rank_info, device=self.device, states=states)  # fmt: skip

    # -- spiking networks ------------------------------------------------------------------------

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """A static input as a ``[T, N, ...]`` sequence on the engine's device (config ``snn``:
        ``time_steps`` and ``encoding``, repeat or poisson)."""
        x = x.to(self.device, non_blocking=True)
        return encode(x, self.config.snn.time_steps, self.config.snn.encoding)

    def reset_neurons(self) -> None:
        """Reset the state of every spiking neuron now (for scripts with ``snn.reset: off``)."""
        self.snn.reset()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks (a copy; the input is left as it was)."""
        self.heartbeat.enter(COLLECTIVE, collective=True)
        total = self.backend.all_reduce_sum(tensor)
        self.heartbeat.leave(self.global_steps, self.micro_steps)
        return total

    def close(self) -> None:
        """Finish a background save, close the progress bar and metrics file, and leave the process
        group. Runs at interpreter exit too when the script does not call it; twice is harmless."""
        if self._closed:
            return
        self._closed = True
        self._notes.loss = None
        atexit.unregister(self._close_at_exit)
        self._closing.close()  # a background save's failure is raised once everything is down

    def _close_at_exit(self) -> None:
        """``close`` at interpreter exit (the script did not call it): a background save that failed
        still ends the job with its message and status 1, which an exception in atexit would not."""
        try:
            self.close()
        except CheckpointError as err:
            sys.excepthook(type(err), err, None)  # the message, and torchrun's error file
            sys.stderr.flush()
            os._exit(1)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
