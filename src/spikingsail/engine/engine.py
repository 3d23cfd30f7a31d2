"""The training engine: ``loss = engine(batch); engine.backward(loss); engine.step()``.

It keeps DeepSpeed's bookkeeping — ``micro_steps`` counts every ``step()`` call, an optimizer step
happens on accumulation boundaries only and increments ``global_steps`` — and delegates all
parallelism to a ``Backend``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from spikingsail.backends.base import Backend
from spikingsail.checkpoint import engine_state, faults
from spikingsail.checkpoint.engine_state import TrainingState, merged_state_dict
from spikingsail.checkpoint.lock import JobLock, fence
from spikingsail.checkpoint.store import CheckpointStore
from spikingsail.config.parse import check_balance_weights
from spikingsail.config.schema import SailConfig
from spikingsail.data.loader import ShardedLoader
from spikingsail.data.sampler import ReplicaBatchSampler
from spikingsail.engine.balance import Balancer, loss_weight
from spikingsail.engine.preemption import PREEMPTED_EXIT_CODE, PreemptionWatch
from spikingsail.engine.replicas import (
    ReplicaEnv,
    ReplicaGroups,
    checkpoints_to_load,
    local_state,
    own_group_checkpoints,
)
from spikingsail.engine.state import Entry, LoaderPositions, OptimizerHyperparameters, StepCounters
from spikingsail.engine.stragglers import StragglerWatch
from spikingsail.environments import RankInfo
from spikingsail.errors import CheckpointError, ConfigError, SailError
from spikingsail.monitor import heartbeat
from spikingsail.monitor.hangwatch import BACKWARD, CHECKPOINT, COLLECTIVE, FORWARD, OPTIMIZER
from spikingsail.monitor.heartbeat import Heartbeat, NoHeartbeat
from spikingsail.monitor.steps import StepMonitor, StepRecord
from spikingsail.monitor.trackers import check_installed, flatten, make_trackers
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


class Engine:
    """The training loop's one object, what ``SpikingSail(args, model, optimizer).run()`` returns: the
    model wrapped by the chosen backend, called as ``engine(batch)``, with ``backward``, ``step``, a
    sharded ``dataloader``, checkpoints and the trained model out; the same calls on every backend."""

    _pending_save: tuple[engine_state.SaveHandle, bool] | None
    """A background save being written, and whether its failure ends the job."""
    _saved_in_background: bool
    """A background save was made: every step then asks whether one has finished on every rank."""
    _weighted_loader: ShardedLoader | None
    """The training loader made last: its batches' shares weigh the losses."""
    _weighs_losses: bool
    """Losses are weighted by their share of the step: with ``sail.balance``, or once a training
    loader's epochs end with a short step (without either, ``backward`` takes no weight at all)."""

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
        self.config = config
        self.rank_info = rank_info
        self.backend = backend
        _check_optimizer_source(config, optimizer, lr_scheduler)
        if config.sail.seed is not None:
            seed_everything(config.sail.seed)
        if config.sail.deterministic:
            use_deterministic_algorithms()
        self.device = backend.setup()
        try:
            self.module = model.to(self.device)
            self.snn = SpikingSupport.for_model(config.snn, self.module, config.source)
            if config.snn.sync_batchnorm and rank_info.distributed:
                self.module = convert_sync_batchnorm(self.module)  # keeps the Parameter objects
            if config.snn.time_chunk != 0:  # keeps the Parameter objects and the state_dict keys
                adapter = self.snn.adapter.name if self.snn.adapter is not None else None
                self.module = time_chunked(
                    self.module, config.snn, adapter, self.snn.multi_step, config.source
                )
            _keep_neuron_state_per_rank(self.module, self.snn)
            self.precision: Precision = backend.select_precision()
            self.wrapped_module, self.optimizer, self.lr_scheduler = backend.setup_module_and_optimizer(
                self.module, optimizer, lr_scheduler
            )
            self.balancer = self._make_balancer()
            self.stragglers = (
                StragglerWatch(self.module, self.device, world_size=rank_info.world_size,
                               window=config.sail.straggler_window, factor=config.sail.straggler_factor)
                if config.sail.straggler_window and rank_info.world_size > 1 and dist.is_initialized()
                else None
            )  # fmt: skip
            self.heartbeat, self._hang_watch = self._start_hang_watch()
        except BaseException:
            backend.teardown()  # leave the process group: a failed start must not leave it up
            raise
        self._weighted_loader, self._weighs_losses = None, self.balancer is not None
        self.counters = StepCounters(accumulation=config.gradient_accumulation_steps)
        self._window_losses: list[torch.Tensor] = []
        self.loaders = LoaderPositions()
        self._last_save = time.monotonic()
        self._last_saved: tuple[str, int] | None = None  # (directory, micro_steps) of the last save
        self._pending_save, self._saved_in_background = None, False
        self._ckpt_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
        self._preemption = PreemptionWatch(
            config.checkpoint.path is not None and config.checkpoint.save_on_preemption
        )
        # Inputs already on the CPU need no move; skipping the walk keeps tiny steps cheap.
        self._move_inputs = config.sail.move_inputs_to_device and self.device.type != "cpu"
        try:
            self.monitor = self._make_monitor()
        except BaseException:  # a tracker that cannot start: nothing of the engine stays up
            self.heartbeat.close()
            heartbeat.stop(self._hang_watch)
            backend.teardown()
            raise
        self._known_roots: set[str] = set()  # checkpoint directories that existed: not made again
        self._job_lock = self._lock_checkpoint_directory(config.checkpoint.path)
        self._closed = False
        atexit.register(self._close_at_exit)
        self._replica_loader: ShardedLoader | None = None
        self.replicas = self._replica_groups()
        log.info("engine ready: rank %d of %d on %s", rank_info.rank, rank_info.world_size, self.device)

    # -- the training step -------------------------------------------------------------------

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward (what ``engine(batch)`` calls), with the inputs moved to ``engine.device`` and the backend's precision and spiking-neuron handling around it."""
        self.heartbeat.enter(FORWARD)
        if self._move_inputs:
            inputs, kwargs = map_tensors((inputs, kwargs), lambda t: t.to(self.device, non_blocking=True))
        sync = self.is_gradient_accumulation_boundary() or not torch.is_grad_enabled()
        self.snn.before_forward()
        inputs, kwargs = self.backend.prepare_inputs((inputs, kwargs))
        self._count_samples()
        watch = self.stragglers if torch.is_grad_enabled() and self.module.training else None
        start = watch.forward_begins() if watch is not None else None
        with self.backend.gradient_sync(sync), self.precision.autocast():
            out = self.wrapped_module(*inputs, **kwargs)
        if watch is not None:
            watch.forward_ends(start)
        self.heartbeat.leave(self.counters.global_steps, self.counters.micro_steps)
        return out

    def _count_samples(self) -> None:
        """With ``balance: auto``, count this forward's samples when it trains on the balanced loader."""
        share = self._weighted_loader.share if self._weighted_loader is not None else None
        if (
            self.balancer is not None
            and share is not None
            and torch.is_grad_enabled()
            and self.module.training
        ):
            self.balancer.count(share[0])

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` averaged over the accumulation window (and scaled for fp16)."""
        accumulation = self.config.gradient_accumulation_steps
        self.heartbeat.enter(BACKWARD, collective=self.is_gradient_accumulation_boundary())
        self._window_losses.append(loss.detach() / accumulation if accumulation > 1 else loss.detach())
        start = self.stragglers.backward_begins() if self.stragglers is not None else None
        if self.replicas is not None:
            self.backend.backward(loss * self._replica_loss_weight())
        elif not self._weighs_losses:
            self.backend.backward(loss)
        elif self.balancer is None:  # an epoch's short step: each rank's loss weighs its samples
            self.backend.backward(loss * self._loss_weight())
        else:
            with self.balancer.timing_backward():
                self.backend.backward(loss * self._loss_weight())
        if self.stragglers is not None:
            self.stragglers.backward_ends(start)
        self.snn.after_backward(self.is_gradient_accumulation_boundary())
        self.heartbeat.leave(self.counters.global_steps, self.counters.micro_steps)

    def step(self) -> None:
        """End a micro-step; on an accumulation boundary, update the weights."""
        boundary = self.is_gradient_accumulation_boundary()
        self.heartbeat.enter(OPTIMIZER, collective=boundary)
        if boundary and self.replicas is not None and not self.replicas.reduce_and_vote(self._parameters()):
            self._discard_step()
            return
        start = self.stragglers.optimizer_begins() if self.stragglers is not None else None
        skipped = self.backend.step(self.optimizer, self.lr_scheduler, boundary=boundary)
        if self.stragglers is not None:
            self.stragglers.optimizer_ends(start)
        if boundary:
            self._after_optimizer_step(skipped)
        self.counters.micro_steps += 1
        if boundary:
            self._poll_background_save()
            # After the counter moves on: a checkpoint must record the step as finished, or a
            # resume would take its first micro-step for the end of an accumulation window.
            self._maybe_save()
            if self._preemption.agreed(self.device):
                self._save_and_exit_for_requeue()
        self.heartbeat.leave(self.counters.global_steps, self.counters.micro_steps)

    def _parameters(self) -> Iterator[torch.nn.Parameter]:
        return (p for group in self.optimizer.param_groups for p in group["params"])

    def _discard_step(self) -> None:
        """The replica groups did not commit this step: forget its gradients and take it again
        (the engine's loader serves the same samples)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._window_losses = []
        self.counters.micro_steps = self.counters.global_steps * self.config.gradient_accumulation_steps
        log.warning("step %d not committed by the replica groups (a peer failed): taking it again",
                    self.counters.global_steps + 1)  # fmt: skip
        self.heartbeat.leave(self.counters.global_steps, self.counters.micro_steps)

    def _replica_loss_weight(self) -> float:
        """n × accumulation × this rank's samples / the step's: DDP averages over the group's n ranks and
        the groups' gradients are summed, so the step's gradient is the mean over the global batch."""
        share = self._replica_loader.share if self._replica_loader is not None else None
        if share is None:
            raise ConfigError(
                "the job runs as replica groups (sail launch --ft-replicas), but this loss does not "
                "come from a batch of engine.dataloader(...)",
                "while a group is missing the others take its share of every step, which only the "
                "engine's loader knows",
                "iterate engine.dataloader(dataset) for training",
            )
        return loss_weight(*share, self.rank_info.world_size, self.counters.accumulation)

    def _replica_groups(self) -> ReplicaGroups | None:
        """Under ``sail launch --ft-replicas``: this group's torchft manager (no quorum yet)."""
        self.replicas = None  # close() reads it
        env = ReplicaEnv.from_env()
        if env is None:
            return None
        try:
            if self.config.checkpoint.path is None and self.rank_info.is_rank_zero:
                log.warning("replica group %d has no checkpoint path: if it restarts while no other group is "
                            "alive it starts from step 0 (pass --resume --checkpoints-path DIR)", env.group)  # fmt: skip
            state = (self._live_state, self._load_live_state)
            return ReplicaGroups(
                self.config.fault_tolerance, env, self.rank_info, self.device, state, self._replicated_tensors
            )
        except BaseException:  # torchft could not start: nothing of the engine stays up
            self.close()
            raise

    def join_replica_groups(self) -> None:
        """Take the first quorum of a job of replica groups (``initialize`` does, after a resume and
        before the script makes its loaders): a group behind the others heals here — torchft loads a
        live group's state into it (``_load_live_state``) — and takes part in their step."""
        if self.replicas is None:
            return
        self._refuse_inside_window("resume")
        self.replicas.begin_step()
        if self.counters.global_steps:
            log.info(
                "replica group %d in the job at step %d", self.replicas.env.group, self.counters.global_steps
            )

    def _refuse_inside_window(self, what: str) -> None:
        accumulation = self.config.gradient_accumulation_steps
        if self.counters.micro_steps % accumulation:
            raise ConfigError(
                f"cannot {what} inside a gradient accumulation window with replica groups (micro-step "
                f"{self.counters.micro_steps % accumulation} of {accumulation} of step {self.global_steps + 1})",
                "each replica group holds only its own share of the window's gradient, and a resume "
                "continues from one group's checkpoint",
                "save on a step boundary (is_gradient_accumulation_boundary(); the periodic saves do)",
            )

    def _live_state(self) -> dict[str, Any]:
        """What a healing replica group takes from this one (with ``fsdp``, this rank's shards: its
        counterpart in the healing group holds the same ones)."""
        return {"model": local_state(self.module.state_dict()), "optimizer": local_state(self.optimizer.state_dict()),
                "engine": self.state_dict()}  # fmt: skip

    def _replicated_tensors(self) -> Iterator[torch.Tensor]:
        """What every replica group must hold bit for bit at the same step: the model's state and the
        optimizer's."""
        yield from self.module.state_dict().values()
        for state in self.optimizer.state.values():
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))

    def _load_live_state(self, state: dict[str, Any]) -> None:
        self.backend.load_live_state(self.module, self.optimizer, state)
        self.load_state_dict(state["engine"])

    def _loss_weight(self) -> float:
        """This rank's share of the optimizer step's samples, relative to an equal share of a whole
        step (``sail.balance``, an epoch's short step)."""
        share = self._weighted_loader.share if self._weighted_loader is not None else None
        if self.balancer is None:  # a loss from elsewhere than the loader with the short step weighs 1
            return 1.0 if share is None else loss_weight(*share, self.world_size, self.counters.accumulation)
        if share is None:
            raise ConfigError(
                f"{self.config.source}: sail.balance is {self.config.sail.balance!r}, but this loss does not "
                "come from a batch of engine.dataloader(...)",
                "with unequal micro-batches each rank's loss is weighted by its share of the global "
                "micro-batch, which only the engine's loader knows",
                "iterate engine.dataloader(dataset) for training, or turn sail.balance off",
            )
        return self.balancer.loss_weight(*share)

    def _make_balancer(self) -> Balancer | None:
        balance, config = self.config.sail.balance, self.config
        if balance == "off":
            return None
        weights: list[float] | None = None
        if isinstance(balance, tuple):
            weights = list(balance)
        elif isinstance(balance, dict):
            hosts = self._rank_hosts()
            missing = sorted(set(hosts) - set(balance))
            if missing:
                raise ConfigError(
                    f"{config.source}: sail.balance has no weight for host(s) {', '.join(missing)}",
                    f"the ranks run on {', '.join(sorted(set(hosts)))}; the map names {', '.join(balance)}",
                    'give every host a weight (its GPUs\' relative speed), or use "auto"',
                )
            weights = [balance[host] for host in hosts]
            check_balance_weights(weights, config, hosts)
        balancer = Balancer(
            global_micro_batch=config.train_micro_batch_size_per_gpu * config.world_size,
            world_size=config.world_size,
            weights=weights,
            rebalance_factor=config.sail.rebalance_factor,
            accumulation=config.gradient_accumulation_steps,
        )
        balancer.attach(self.module, self.device)
        if self.rank_info.is_rank_zero:
            log.info("balance %s: micro-batches per rank %s", "auto" if weights is None else "by weight",
                     balancer.split)  # fmt: skip
        return balancer

    def _make_monitor(self) -> StepMonitor:
        """Rank 0's progress bar, metrics file and trackers (``sail.trackers`` in ``log_dir``)."""
        sail, zero = self.config.sail, self.rank_info.is_rank_zero
        metrics_path = sail.metrics_path
        if metrics_path is None and "jsonl" in sail.trackers:
            metrics_path = str(self.log_dir / "metrics.jsonl")
        check_installed(sail.trackers)
        made = make_trackers(sail.trackers, self.log_dir) if zero and sail.trackers else []
        monitor = StepMonitor(
            enabled=zero,
            samples_per_step=self.config.train_batch_size,
            steps_per_print=self.config.steps_per_print,
            progress_bar=sail.progress_bar,
            metrics_path=metrics_path,
            trackers=made,
        )
        monitor.log_hyperparams(flatten(self.config.raw))
        return monitor

    @functools.cached_property
    def log_dir(self) -> Path:
        """The run's directory (``sail.log_dir``): with trackers and none set, ``runs/DATE-TIME``;
        else beside the metrics file, or the working directory (where a hang report goes)."""
        sail = self.config.sail
        if sail.log_dir is not None:
            return Path(sail.log_dir)
        if sail.trackers:
            return Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        return Path(sail.metrics_path).parent if sail.metrics_path else Path.cwd()

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """The script's own scalars (``{"val/accuracy": 0.93}``; numbers or one-element tensors) at
        ``step`` (default: the optimizer steps so far), to the trackers and the metrics file. Rank 0
        writes; on the other ranks it does nothing (log what rank 0 knows, or all-reduce first)."""
        if not self.rank_info.is_rank_zero:
            return
        values = {str(k): float(v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
        self.monitor.log(values, self.global_steps if step is None else step)

    def _start_hang_watch(self) -> tuple[Heartbeat | NoHeartbeat, subprocess.Popen[bytes] | None]:
        """Progress records and each node's hang watch (``sail.hang_timeout_seconds``)."""
        sail = self.config.sail
        if not (sail.hang_timeout_seconds and self.world_size > 1 and dist.is_initialized()):
            return NoHeartbeat(), None
        if sail.hang_timeout_seconds >= 60 * sail.timeout_minutes and self.rank_info.is_rank_zero:
            log.warning("sail.hang_timeout_seconds (%g) is not below sail.timeout_minutes (%g min): a hung "
                        "collective times out before the hang watch can report who holds it up",
                        sail.hang_timeout_seconds, sail.timeout_minutes)  # fmt: skip
        return heartbeat.start(
            rank=self.rank, world_size=self.world_size, timeout=sail.hang_timeout_seconds,
            report_dir=str(self.log_dir.resolve()), board_host=os.environ.get("MASTER_ADDR"),
        )  # fmt: skip

    def _rank_hosts(self) -> list[str]:
        hosts: list[Any] = [socket.gethostname()] * self.world_size
        if dist.is_initialized():
            dist.all_gather_object(hosts, socket.gethostname())
        return [str(h) for h in hosts]

    def _save_and_exit_for_requeue(self) -> None:
        assert self.config.checkpoint.path is not None  # the watch is armed only with a path
        root = self.config.checkpoint.path
        if self._last_saved == (str(Path(root)), self.micro_steps):
            # this step's periodic save holds exactly this state: writing it again would only
            # replace a good checkpoint with the same bytes
            self._settle_pending(stops=True)
            path = str(Path(root) / f"global_step{self.global_steps}")
        else:
            path = self.save_checkpoint(root, async_save=False)
        log.warning("preempted by signal %s: saved %s; exiting with status %d (requeue me)",
                    self._preemption.signal_name, path, PREEMPTED_EXIT_CODE)  # fmt: skip
        self.close()
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def _after_optimizer_step(self, overflow: bool) -> None:
        counters = self.counters
        if overflow:
            counters.skipped_steps += 1
            log.warning(
                "fp16 overflow: step %d skipped, loss scale now %g",
                counters.global_steps,
                self.loss_scale,
            )
        counters.global_steps += 1
        counters.global_samples += self.config.train_batch_size
        change = None
        if self.balancer is not None:
            change = self.balancer.after_step(counters.global_steps, self.backend.all_reduce_sum, self.rank)
        stragglers = None
        if self.stragglers is not None:
            stragglers = self.stragglers.after_step(
                counters.global_steps, self.rank, self.backend.all_reduce_sum, self._rank_hosts
            )
        if self.monitor.wants(self.global_steps):
            losses = self._window_losses
            self.monitor.on_step(
                StepRecord(
                    step=self.global_steps,
                    loss=torch.stack(losses).float().sum() if losses else None,
                    lr=self.get_lr()[0],
                    loss_scale=self.loss_scale,
                    skipped=overflow,
                    balance=change,
                    stragglers=stragglers,
                )
            )
        self._window_losses = []

    def _maybe_save(self) -> None:
        policy = self.config.checkpoint
        if not policy.path or not (policy.interval_steps or policy.interval_seconds):
            return
        due = bool(policy.interval_steps) and self.global_steps % policy.interval_steps == 0
        if policy.interval_seconds:
            # Ranks' clocks differ: rank 0's decides, or some ranks would enter the save alone.
            # The flag is made on the collective's device and read back from the tensor the
            # broadcast wrote (on a GPU, ``.to()`` of a CPU tensor is a copy).
            elapsed = torch.tensor(
                [time.monotonic() - self._last_save >= policy.interval_seconds],
                dtype=torch.int32,
                device=self.device,
            )
            if dist.is_initialized():
                dist.broadcast(elapsed, src=0)
            due = due or bool(elapsed.item())
        if not due:
            return
        try:
            self._save(policy.path, stops=policy.on_error == "stop")
        except CheckpointError as err:
            if policy.on_error == "stop":
                raise
            self._warn_failed_save(err)

    def _warn_failed_save(self, err: CheckpointError) -> None:
        """checkpoint.on_error "continue": every rank's log and the metrics file say so; training goes on."""
        log.warning("%s\n  (checkpoint.on_error is 'continue': training goes on, and the next save comes at "
                    "the next interval)", err)  # fmt: skip
        self.monitor.event("checkpoint_failed", str(err), self.global_steps)

    def _poll_background_save(self) -> None:
        """A background save that has finished on every rank is settled at the step where all of
        them know it (its failure then surfaces on every rank at the same step)."""
        if not self._saved_in_background:
            return
        finished = self._pending_save is None or self._pending_save[0].done.done()
        if dist.is_initialized() and self.world_size > 1:
            # every step once a background save was made, pending here or not: a rank that waited
            # for its save alone (wait_for_checkpoint) must still take part
            # the default group, not the checkpoint group: the writer thread may be using that one
            flag = torch.tensor([int(finished)], dtype=torch.int32, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            finished = bool(flag.item())
        if finished and self._pending_save is not None:
            self._settle_pending()

    # -- DeepSpeed-compatible accessors --------------------------------------------------------

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
        # with sail.balance, a training loader hands each rank its share of every global micro-batch
        shares = self.balancer.shares if self.balancer is not None and pad and batch_size is None else None
        training = pad and batch_size is None
        replicated = (
            self._replica_sampler(dataset, shuffle, seed, drop_last, loader_kwargs) if training else None
        )
        # a training loader reads its epochs in optimizer steps, the last one short on any split alike
        accumulation = self.config.gradient_accumulation_steps if training and replicated is None else None
        loader = ShardedLoader(
            dataset,
            batch_size=batch_size or self.config.train_micro_batch_size_per_gpu,
            rank=self.rank,
            world_size=self.world_size,
            shuffle=shuffle,
            drop_last=drop_last,
            pad=pad,
            seed=seed if seed is not None else (self.config.sail.seed or 0),
            pin_memory=self.device.type == "cuda" if pin_memory is None else pin_memory,
            collate_fn=collate_fn,
            on_batch=self.snn.on_batch if self.snn.manages_state or self.config.snn.check_state else None,
            device=self.device if self._move_inputs else None,
            shares=shares,
            accumulation=accumulation,
            replicated=replicated,
            **loader_kwargs,
        )
        if accumulation is not None or shares is not None:  # the training loader: the last one made
            self._weighted_loader = loader
            self._weighs_losses = self._weighs_losses or loader.weighs_losses
        if replicated is not None:
            self._replica_loader = loader
        self.loaders.add(loader, dataset, arguments)
        return loader

    def _replica_sampler(
        self,
        dataset: Dataset[Any],
        shuffle: bool,
        seed: int | None,
        drop_last: bool,
        loader_kwargs: dict[str, Any],
    ) -> ReplicaBatchSampler | None:
        if self.replicas is None:
            return None
        if loader_kwargs.get("num_workers", 0):
            raise ConfigError(
                f"engine.dataloader(num_workers={loader_kwargs['num_workers']}) in a job of replica groups "
                "(sail launch --ft-replicas)",
                "each batch follows the step's quorum and whether the last step committed; "
                "worker processes would take batches ahead of both",
                "leave num_workers at 0 for the training loader (an evaluation loader, pad=False, may use workers)",
            )
        accumulation = self.config.gradient_accumulation_steps
        return ReplicaBatchSampler(
            len(dataset),  # type: ignore[arg-type]
            micro_samples=self.config.train_micro_batch_size_per_gpu * self.config.world_size,
            accumulation=accumulation,
            ranks=self.config.world_size,
            split=self.replicas.split,
            progress=lambda: (self.counters.global_steps, self.counters.micro_steps % accumulation),
            shuffle=shuffle,
            seed=seed if seed is not None else (self.config.sail.seed or 0),
            drop_last=drop_last,
        )

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
        return self._save(save_dir, tag, client_state, async_save=async_save, stops=True)

    def _save(
        self,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        *,
        async_save: bool | None = None,
        stops: bool,
    ) -> str:
        """``save_checkpoint``; ``stops``: whether a failure of this save in the background ends the
        job (raised where it surfaces) or is only reported (a periodic save under on_error "continue")."""
        self.wait_for_checkpoint()
        if self.replicas is not None:
            self._refuse_inside_window("save")
            save_dir = own_group_checkpoints(save_dir, self.replicas.env.group)
        self._agree(lambda: fence(save_dir))  # a job whose directory lock was taken over saves nothing
        background = self.config.checkpoint.async_save if async_save is None else async_save
        root = str(Path(save_dir))
        self.heartbeat.enter(CHECKPOINT)
        try:
            handle = engine_state.save(
                self._training_state(), save_dir, tag, client_state, group=self._checkpoint_group(),
                writer_group=self._writer_group(), background=background, create=root not in self._known_roots,
            )  # fmt: skip
        finally:
            # a failed save is tried again at the next interval, not at the next step
            self._last_save = time.monotonic()
            self.heartbeat.leave(self.counters.global_steps, self.counters.micro_steps)
        self._known_roots.add(root)
        self._last_saved = (root, self.micro_steps) if tag is None else None
        if background:
            self._pending_save, self._saved_in_background = (handle, stops), True
            log.info("checkpoint %s: writing in the background", handle.path)
        else:
            log.info("checkpoint saved: %s", handle.path)
        return str(handle.path)

    def wait_for_checkpoint(self) -> None:
        """Block until a background save has been written and committed. If it failed: raise its
        error on every rank — or, for a periodic save under checkpoint.on_error "continue", warn."""
        self._settle_pending()

    def _settle_pending(self, *, stops: bool | None = None) -> None:
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return
        handle, pending_stops = pending
        from torch.distributed.checkpoint.api import CheckpointException

        from spikingsail.checkpoint import dcp_io

        try:
            handle.wait()
        except CheckpointError as err:
            failure = err
        except (Exception, CheckpointException) as err:
            failure = CheckpointError(
                f"the background save of {handle.path} failed",
                dcp_io.describe(err),
                "the previous checkpoint is intact and still 'latest'; check free space and permissions",
            )
            failure.__cause__ = err
        else:
            log.info("checkpoint saved: %s", handle.path)
            return
        self._last_saved = None
        if pending_stops if stops is None else stops:
            raise failure
        self._warn_failed_save(failure)

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

        if dtype not in export.DTYPES.values():
            raise SailError(f"save_model(dtype={dtype}): not a floating dtype a model is saved in",
                            fix="use torch.float32, torch.bfloat16 or torch.float16")  # fmt: skip
        self._agree(lambda: export.check_output_path(path))  # before the gather: every rank stops
        self.wait_for_checkpoint()
        self.heartbeat.enter(CHECKPOINT)
        state = self.backend.consolidated_state_dict(self.module)
        self.heartbeat.leave(self.counters.global_steps, self.counters.micro_steps)

        def write() -> str:
            metadata = export.model_metadata(self.backend.name, self.global_steps)
            written = str(export.write_model(export.cast(state, dtype), path, metadata))
            log.info(
                "model saved: %s (%d tensors, %s)", written, len(state), str(dtype).removeprefix("torch.")
            )
            return written

        written = self._agree(write)
        return written if self.rank_info.is_rank_zero else None

    def _agree(self, action: Callable[[], Any]) -> Any:
        """Run ``action`` on rank 0 and hand every rank its result, or raise its ``SailError`` on
        every rank (so that no rank waits for one that stopped)."""
        outcome: list[Any] = [None]
        if self.rank_info.is_rank_zero:
            try:
                outcome = [("ok", action())]
            except SailError as err:
                outcome = [("error", err)]
        if dist.is_initialized() and self.rank_info.world_size > 1:
            dist.broadcast_object_list(outcome, src=0)
        kind, value = outcome[0]
        if kind == "error":
            raise value
        return value

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
        self.wait_for_checkpoint()
        self._last_saved = None
        load_dir = self._agreed(str(checkpoints_to_load(load_dir, tag)))
        training = self._training_state(with_optimizer=load_optimizer_states)
        if load_module_only:
            path, client_state = engine_state.load_weights(
                training, load_dir, tag, group=self._checkpoint_group()
            )
            log.info("weights loaded from %s; training starts at step 0", path)
            return str(path), client_state
        self.heartbeat.enter(CHECKPOINT)
        path, client_state = engine_state.load(training, load_dir, tag, group=self._checkpoint_group())
        self.heartbeat.leave(self.counters.global_steps, self.counters.micro_steps)
        self.backend.sync_counters(
            self.micro_steps, self.global_steps, self.global_samples, self.skipped_steps
        )
        self.snn.after_load()
        log.info("resumed from %s at step %d", path, self.global_steps)
        return str(path), client_state

    def _agreed(self, choice: str) -> str:
        """Rank 0's ``choice`` on every rank (what rank 0 saw of a directory another replica group may
        be writing to)."""
        if self.replicas is None or self.world_size == 1 or not dist.is_initialized():
            return choice
        chosen = [choice]
        dist.broadcast_object_list(chosen, src=0)
        return str(chosen[0])

    def _lock_checkpoint_directory(self, directory: str | None) -> JobLock | None:
        """Rank 0 takes the job lock of the checkpoint directory (``checkpoint/lock.py``); every rank
        learns whether it did, so that a refusal ends every rank, not only rank 0."""
        if directory is None:
            return None
        try:
            self._check_checkpoint_directory(Path(directory))
            return self._agree_on_lock(JobLock(directory) if self.rank_info.is_rank_zero else None)
        except BaseException:
            self.monitor.close()
            self.heartbeat.close()
            heartbeat.stop(self._hang_watch)
            self._destroy_checkpoint_group()
            self.backend.teardown()  # a refused start leaves no process group up
            raise

    def _check_checkpoint_directory(self, root: Path) -> None:
        """Before the first step: every rank can create and write the checkpoint directory (each
        node's, when it is node-local), and it has room for the checkpoints keep_last keeps."""
        who = f"rank {self.rank} on {socket.gethostname()}"
        problem = faults.probe(root, create=True, who=who)
        group = self._checkpoint_group()
        problems = [problem]
        if group is not None:
            problems = [None] * self.world_size
            dist.all_gather_object(problems, problem, group=group)
        found = [p for p in problems if p is not None]
        if found:
            raise CheckpointError(
                f"cannot save checkpoints in {root}: {len(found)} of {len(problems)} rank(s) cannot write there",
                "; ".join(found),
                "make the directory writable by the job's user on every node, or choose another "
                "--checkpoints-path (this is checked before the first step, not at the first save)",
            )
        self._known_roots.add(str(root))
        self._agree(lambda: self._check_room(root))

    def _check_room(self, root: Path) -> None:
        """Room for keep_last + 1 checkpoints (the one being written), less those already there."""
        keep_last = self.config.checkpoint.keep_last
        existing = len(CheckpointStore(root).tags())
        copies = max(1, (keep_last or 1) + 1 - min(existing, keep_last or 1))
        estimate = faults.estimate_bytes(self.module, self.optimizer)
        refusal = faults.check_room(root, estimate, copies)
        if refusal is not None:
            raise refusal

    def _agree_on_lock(self, lock: JobLock | None) -> JobLock | None:
        refusal: tuple[str, str, str] | None = None
        if lock is not None:
            try:
                lock.acquire()
            except CheckpointError as err:
                refusal = (err.what, err.why, err.fix)
        group = self._checkpoint_group()
        if group is not None:
            box = [refusal]
            dist.broadcast_object_list(box, src=0, group=group)
            refusal = box[0]
        if refusal is not None:
            raise CheckpointError(*refusal)
        return lock

    def _checkpoint_group(self) -> dist.ProcessGroup | None:
        """A gloo group of its own for checkpoint coordination, also from a background thread."""
        return self._checkpoint_groups()[0]

    def _writer_group(self) -> dist.ProcessGroup | None:
        """The group a background save's writer thread uses: while it writes, the ranks agree on
        the save's start in the coordination group (one group used by two threads at once would
        see their collectives in different orders on different ranks)."""
        return self._checkpoint_groups()[1]

    def _checkpoint_groups(self) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        if not dist.is_initialized():
            return None, None
        if self._ckpt_groups is None:
            coordination, writer = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")  # all ranks
            assert isinstance(coordination, dist.ProcessGroup) and isinstance(writer, dist.ProcessGroup)
            self._ckpt_groups = coordination, writer
        return self._ckpt_groups[0], self._ckpt_groups[1]

    def restore_loaders(self, states: list[dict[str, int]]) -> None:
        """Data positions from a checkpoint, for loaders made so far and those made later (by order)."""
        self.loaders.restore(states)

    # -- state -----------------------------------------------------------------------------------

    def state_parts(self, *, with_optimizer: bool = True) -> dict[str, Stateful]:
        """The engine's ``Stateful`` parts, in the order they are restored (the optimizer's settings
        before the scheduler's state, which may read them)."""
        parts: dict[str, Stateful] = {"counters": self.counters}
        if with_optimizer:
            parts["optimizer"] = OptimizerHyperparameters(self.optimizer)
        parts["lr_scheduler"] = Entry("lr_scheduler", self.lr_scheduler)
        parts["precision"] = Entry("precision", self.precision)
        parts["loaders"] = self.loaders
        parts["balance"] = Entry("balance", self.balancer)
        parts["fault_tolerance"] = Entry("fault_tolerance", self.replicas)
        return parts

    def state_dict(self) -> dict[str, Any]:
        """Counters, optimizer settings, scheduler, loss scaler and data positions (not the model
        and optimizer tensors, which the backend saves)."""
        return merged_state_dict(self.state_parts())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict()`` returned: the model, optimizer and every stateful part of the engine."""
        for part in self.state_parts().values():
            part.load_state_dict(state_dict)

    def _training_state(self, *, with_optimizer: bool = True) -> TrainingState:
        return TrainingState(
            module=self.module,
            optimizer=self.optimizer if with_optimizer else None,
            backend=self.backend,
            config=self.config,
            rank_info=self.rank_info,
            device=self.device,
            states=self.state_parts(with_optimizer=with_optimizer),
        )

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
        self.heartbeat.leave(self.counters.global_steps, self.counters.micro_steps)
        return total

    def close(self) -> None:
        """Finish a background save, close the progress bar and metrics file, and leave the process group.

        Runs at interpreter exit too when the script does not call it; calling it twice is harmless.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        self._preemption.disarm()
        failure: CheckpointError | None = None
        try:
            self._settle_pending()
        except CheckpointError as err:  # raised once the engine is down
            failure = err
        finally:
            self.monitor.close()
            if self.balancer is not None:
                self.balancer.close()
            if self.stragglers is not None:
                self.stragglers.close()
            self.heartbeat.close()
            heartbeat.stop(self._hang_watch)
            if self._job_lock is not None:
                self._job_lock.release()
            self._destroy_checkpoint_group()
            if self.replicas is not None:
                self.replicas.shutdown()
            self.backend.teardown()
        if failure is not None:
            raise failure

    def _close_at_exit(self) -> None:
        """``close`` at interpreter exit (the script did not call it): a background save that failed
        still ends the job with its message and status 1, which an exception in atexit would not."""
        try:
            self.close()
        except CheckpointError as err:
            sys.excepthook(type(err), err, None)  # the message, and torchrun's error file
            sys.stderr.flush()
            os._exit(1)

    def _destroy_checkpoint_group(self) -> None:
        if self._ckpt_groups is not None:
            # now, not at interpreter exit, and also when the default group is the user's
            if dist.is_initialized():
                for group in self._ckpt_groups:
                    dist.destroy_process_group(group)
            self._ckpt_groups = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_optimizer_source(
    config: SailConfig, optimizer: torch.optim.Optimizer | None, lr_scheduler: LRScheduler | None = None
) -> None:
    if optimizer is None and config.optimizer is None:
        raise ConfigError(
            f"{config.source}: no optimizer",
            "the engine steps an optimizer, and neither the call nor the config provides one",
            'pass optimizer= to SpikingSail/initialize, or add "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}',
        )
    if optimizer is not None and config.optimizer is not None:
        log.warning(
            "%s: the optimizer passed to the engine is used; the config's optimizer section (%s) is ignored",
            config.source,
            config.optimizer.type,
        )
    if lr_scheduler is not None and config.scheduler is not None:
        log.warning(
            "%s: the lr_scheduler passed to the engine (%s) is used; the config's scheduler section (%s) is ignored",
            config.source,
            type(lr_scheduler).__name__,
            config.scheduler.type,
        )


def use_deterministic_algorithms() -> None:
    """Only deterministic kernels from here on. cuBLAS reads CUBLAS_WORKSPACE_CONFIG when CUDA
    starts, so it is set here, before the engine touches the GPU; a script that used CUDA earlier
    must export it itself (torch then raises at the first non-deterministic cuBLAS call)."""
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            log.warning("sail.deterministic: CUDA started before the engine, without CUBLAS_WORKSPACE_CONFIG; "
                        "export CUBLAS_WORKSPACE_CONFIG=:4096:8 before starting the script")  # fmt: skip
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _keep_neuron_state_per_rank(module: torch.nn.Module, snn: SpikingSupport) -> None:
    """Neuron state kept in buffers (snntorch's ``mem``) is each rank's own: DDP, which broadcasts
    rank 0's buffers at every forward, must leave it alone (and could not broadcast it anyway when
    the ranks' batches differ in size)."""
    if snn.adapter is None:
        return
    neurons = {id(m) for m in snn.modules}
    names = [
        f"{prefix}.{buffer}" if prefix else buffer
        for prefix, m in module.named_modules()
        if id(m) in neurons
        for buffer in snn.adapter.state_buffers(m)
    ]
    if names:
        ignored = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
        ignore = DistributedDataParallel._set_params_and_buffers_to_ignore_for_model
        ignore(module, ignored + names)  # type: ignore[no-untyped-call]  # torch's own, for exactly this
