"""Entry points: ``SpikingSail(args, model, optimizer).run()``, ``initialize(...)`` and the CLI flags.

This is the boundary where the environment and the config are read and validated, in that
order, before any process group is created.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import io
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spikingsail.backends import Backend, available, backend_class, load_config, sharding_backends
from spikingsail.checkpoint.replica_dirs import (
    checkpoints_to_load,
    group_checkpoints,
    newest_group_checkpoints,
)
from spikingsail.checkpoint.store import CheckpointStore
from spikingsail.config.schema import SailConfig, summary
from spikingsail.config.zero import offloads
from spikingsail.engine.engine import Engine, LRScheduler
from spikingsail.engine.replicas import ReplicaEnv, check_supported
from spikingsail.engine.setup import passed
from spikingsail.environments import RankInfo, discover_rank_info
from spikingsail.errors import ConfigError
from spikingsail.monitor.logs import ensure_logging, report_sail_errors
from spikingsail.snn.syncbn import MultiStepSyncBatchNorm

log = logging.getLogger(__name__)

ConfigSource = str | Path | dict[str, Any] | None


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add SpikingSail's flags, DeepSpeed's spellings of them and the legacy ``--local_rank``."""
    group = parser.add_argument_group("SpikingSail")
    group.add_argument(
        "--sail-config",
        "--sail_config",
        dest="sail_config",
        metavar="PATH",
        help="training config (DeepSpeed-format JSON)",
    )
    group.add_argument("--deepspeed", action="store_true", help="accepted for DeepSpeed scripts")
    group.add_argument(
        "--deepspeed_config",
        "--deepspeed-config",
        dest="deepspeed_config",
        metavar="PATH",
        help="DeepSpeed's name for --sail-config",
    )
    # torch.distributed.launch appends --local-rank=N (--local_rank before torch 2.0); scripts
    # written for it often declare the flag themselves, so only add it when it is missing.
    group.add_argument(
        "--checkpoints-path",
        "--checkpoints_path",
        dest="checkpoints_path",
        metavar="DIR",
        help="where checkpoints are saved and resumed from",
    )
    group.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest good checkpoint in --checkpoints-path (if there is one)",
    )
    group.add_argument(
        "--resume-from",
        "--resume_from",
        dest="resume_from",
        metavar="TAG",
        help="continue from this checkpoint tag",
    )
    if not any(s in parser._option_string_actions for s in ("--local_rank", "--local-rank")):
        group.add_argument(
            "--local_rank", "--local-rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS
        )
    return parser


class SpikingSail:
    """Seed 000's entry point: ``engine, optimizer = SpikingSail(args, model, optimizer).run()``."""

    def __init__(
        self,
        args: argparse.Namespace | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        lr_scheduler: LRScheduler | None = None,
        config: ConfigSource = None,
    ) -> None:
        self.args = args
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.config = config

    def run(self) -> tuple[Engine, torch.optim.Optimizer]:
        """Build the engine from the parsed arguments: the config they name (``--sail-config`` or
        ``--deepspeed_config``), ``--checkpoints-path`` and ``--resume``; returns ``(engine, optimizer)``
        as ``initialize`` does."""
        report_sail_errors()
        source = _config_from_args(self.args, self.config)
        local_rank = getattr(self.args, "local_rank", None)
        return initialize(
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            config=source,
            local_rank=local_rank if local_rank is None or local_rank >= 0 else None,
            checkpoints_path=getattr(self.args, "checkpoints_path", None),
            resume=bool(getattr(self.args, "resume", False)),
            resume_from=getattr(self.args, "resume_from", None),
        )


def initialize(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    config: ConfigSource = None,
    lr_scheduler: LRScheduler | None = None,
    local_rank: int | None = None,
    rank_info: RankInfo | None = None,
    checkpoints_path: str | None = None,
    resume: bool = False,
    resume_from: str | None = None,
) -> tuple[Engine, torch.optim.Optimizer]:
    """Build the engine; returns ``(engine, optimizer)`` with the optimizer as the backend wrapped it.

    With ``resume`` the engine continues from the latest good checkpoint under ``checkpoints_path``
    (or the config's ``checkpoint.path``) when there is one, and starts fresh when there is none
    yet — so the same command serves the first start and every restart.
    """
    report_sail_errors()  # a mistake found before the rank is known prints clearly too
    rank_info = rank_info or discover_rank_info(local_rank_arg=local_rank)
    ensure_logging(rank_info.rank)
    _python_stacks_on_crash()
    replicas = ReplicaEnv.from_env()
    # with replica groups (sail launch --ft-replicas) the batch sizes count the ranks of all groups
    sail_config = load_config(config, rank_info.world_size * (replicas.groups if replicas else 1))
    if checkpoints_path:
        checkpoint = dataclasses.replace(sail_config.checkpoint, path=checkpoints_path)
        sail_config = dataclasses.replace(sail_config, checkpoint=checkpoint)
    checkpoint_root = sail_config.checkpoint.path
    if replicas is not None and checkpoint_root:
        checkpoint = dataclasses.replace(
            sail_config.checkpoint, path=str(group_checkpoints(checkpoint_root, replicas.group))
        )
        sail_config = dataclasses.replace(sail_config, checkpoint=checkpoint)
    if (resume or resume_from) and not sail_config.checkpoint.path:
        raise ConfigError(
            "--resume needs to know where the checkpoints are",
            fix='pass --checkpoints-path DIR, or set "checkpoint": {"path": DIR} in the config',
        )
    backend_cls = backend_class(sail_config.sail.backend, sail_config.source)
    if rank_info.is_rank_zero:
        log.info(
            "SpikingSail config (%s):\n%s",
            rank_info.source,
            summary(sail_config, passed(optimizer), passed(lr_scheduler)),
        )
        _report_unused(sail_config, backend_cls)
    # on every rank; before the backend starts (DeepSpeed's own batch checks would speak first)
    check_config(sail_config, backend_cls, model, replica_groups=replicas is not None)
    engine = Engine(
        model=model,
        config=sail_config,
        rank_info=rank_info,
        backend=backend_cls(sail_config, rank_info),
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
    )
    path = sail_config.checkpoint.path
    if replicas is not None and resume and not resume_from:
        # the furthest of every group's checkpoints (rank 0's choice: a peer may be saving meanwhile)
        chosen = [str(newest_group_checkpoints(str(checkpoint_root)) or path)]
        if dist.is_initialized():
            dist.broadcast_object_list(chosen, src=0)
        path = chosen[0]
    if resume_from:
        engine.load_checkpoint(str(path), resume_from)
    elif resume and CheckpointStore(checkpoints_to_load(str(path))).has_checkpoints():
        engine.load_checkpoint(str(path))  # a job of replica groups saved under path: the furthest group's
    elif resume:
        log.info("no checkpoint in %s yet: starting from the beginning", path)
    try:
        engine.join_replica_groups()
    except BaseException:  # refused (inside a window) or no quorum: nothing of the engine stays up
        engine.close()
        raise
    return engine, engine.optimizer


def _config_from_args(args: argparse.Namespace | None, config: ConfigSource) -> ConfigSource:
    paths = {p for p in (getattr(args, "sail_config", None), getattr(args, "deepspeed_config", None)) if p}
    if len(paths) > 1:
        raise ConfigError(
            f"--sail-config and --deepspeed_config name different files: {', '.join(sorted(paths))}",
            fix="pass one of them",
        )
    if paths and config is not None:
        raise ConfigError(
            f"a config was passed both on the command line ({paths.pop()}) and as config=",
            fix="drop one of them",
        )
    if paths:
        return str(paths.pop())
    if config is None and getattr(args, "deepspeed", False):
        raise ConfigError(
            "--deepspeed was given without a config file",
            fix="add --deepspeed_config ds_config.json (or --sail-config)",
        )
    return config


# What SpikingSail offers on every backend for what some DeepSpeed keys do, named in their warning.
_INSTEAD = {
    "tensorboard": 'sail.trackers ["tensorboard"]',
    "wandb": 'sail.trackers ["wandb"]',
    "comet": "sail.trackers (tensorboard, mlflow, wandb)",
    "csv_monitor": "sail.metrics_path, a JSON-lines file of every step",
    "wall_clock_breakdown": "sail.straggler_window: each rank's data, forward, backward and step times",
    "flops_profiler": "torch.profiler around a few steps",
    "activation_checkpointing": "torch.utils.checkpoint in the model (snn.time_chunk for spiking networks)",
}


def _report_unused(config: SailConfig, backend: type[Backend]) -> None:
    unused = [] if backend.reads_deepspeed_config else list(config.inert_keys)
    if not backend.honours_zero_options:
        unused += [f"zero_optimization.{key}" for key in config.zero_optimization.options]
    for key in unused:
        instead = f"; on any backend: {_INSTEAD[key]}" if key in _INSTEAD else ""
        log.warning(
            "%s: '%s' is accepted for DeepSpeed compatibility but has no effect with backend %s "
            '(it takes effect with "sail": {"backend": "deepspeed"}%s; remove it to silence this)',
            config.source,
            key,
            backend.name,
            instead,
        )


def check_config(
    config: SailConfig, backend: type[Backend], model: torch.nn.Module | None = None, *, replica_groups: bool
) -> None:
    """What the engine refuses in a loaded config before it starts its backend: a ZeRO stage, an
    offload or a balance the backend cannot do, and what replica groups cannot do. Without the
    ``model`` (``sail launch``'s check before anything starts) what depends on it is left out."""
    _check_zero_stage(config, backend.name, backend.max_zero_stage)
    _check_offload(config, backend)
    _check_balance(config, backend, model)
    if replica_groups:
        check_supported(config, backend.name, synchronised_batch_norm(config, model))


def _check_offload(config: SailConfig, backend: type[Backend]) -> None:
    asked = offloads(config.zero_optimization.options)
    if asked and not backend.honours_zero_options:
        key, value = next(iter(asked.items()))
        raise ConfigError(
            f"{config.source}: zero_optimization.{key} is {value!r}, an offload that backend {backend.name} "
            "does not do",
            "running without it would silently keep on the GPU what the offload is meant to move off it",
            'set "sail": {"backend": "deepspeed"}, or remove '
            + ", ".join(f"zero_optimization.{k.removesuffix('.device')}" for k in asked),
        )


def _check_zero_stage(config: SailConfig, backend: str, max_stage: int) -> None:
    stage = config.zero_optimization.stage
    if stage > max_stage:
        raise ConfigError(
            f"{config.source}: zero_optimization.stage is {stage}, which backend {backend} does not implement"
            + (f" (it shards up to stage {max_stage})" if max_stage else ""),
            "running it unsharded would silently need the memory the stage is meant to save",
            f'set "sail": {{"backend": ...}} to one of: {", ".join(sharding_backends(stage))}; '
            f"or lower the stage to {max_stage}",
        )


def synchronised_batch_norm(config: SailConfig, model: torch.nn.Module | None) -> str | None:
    """What synchronises batch-norm statistics across ranks in this job, in words, or None."""
    if config.snn.sync_batchnorm:
        return "snn.sync_batchnorm"
    layers = (torch.nn.SyncBatchNorm, MultiStepSyncBatchNorm)
    if model is not None and any(isinstance(m, layers) for m in model.modules()):
        return "the model's SyncBatchNorm layers"
    return None


def _check_balance(config: SailConfig, backend: type[Backend], model: torch.nn.Module | None = None) -> None:
    weights = "give the weights yourself (a list per rank, or a map per host: the GPUs' relative speeds)"
    if config.sail.balance == "auto" and backend.balances and not backend.measures_balance:
        raise ConfigError(
            f"{config.source}: sail.balance is 'auto', which backend {backend.name} cannot measure",
            f"{backend.name}'s ranks wait for each other inside forward and backward, which hides a slow rank",
            weights,
        )
    which = synchronised_batch_norm(config, model)
    if config.sail.balance == "auto" and which:
        raise ConfigError(
            f"{config.source}: sail.balance is 'auto' together with {which}",
            "synchronised batch norm makes the ranks wait for each other inside forward and backward, "
            "which hides a slow rank from the measurement",
            weights + " (weights work with synchronised batch norm)",
        )
    if config.sail.balance != "off" and not backend.balances:
        able = [name for name in available() if backend_class(name).balances]
        raise ConfigError(
            f"{config.source}: sail.balance is {config.sail.balance!r}, which backend {backend.name} does not support",
            f"{backend.name} requires every rank's micro-batch to be train_micro_batch_size_per_gpu",
            f'use "balance": "off", or one of the backends that balance: {", ".join(able)}',
        )


def _python_stacks_on_crash() -> None:
    """A worker killed by SIGSEGV/SIGABRT shows where Python was, not only torchrun's "Signal 6"."""
    if faulthandler.is_enabled():
        return
    # stderr replaced by an object without a file descriptor (notebooks): no stacks, no error
    with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
        faulthandler.enable()
