"""What the engine does once, before its first step: the optimizer's source checked, seeds and
deterministic kernels set, spiking neurons' per-rank state kept out of DDP's buffer broadcast."""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from spikingsail.config.schema import OptimizerConfig, SchedulerConfig
from spikingsail.errors import ConfigError
from spikingsail.snn.support import SpikingSupport

log = logging.getLogger(__name__)


def passed(part: object) -> str | None:
    """The type name of an optimizer or scheduler passed to the engine (None when none was)."""
    return None if part is None else type(part).__name__


def check_optimizer_source(
    optimizer: OptimizerConfig | None, scheduler: SchedulerConfig | None, source: str,
    given: tuple[str | None, str | None],
) -> None:  # fmt: skip
    """The config's ``optimizer`` and ``scheduler`` sections against the ones ``given`` to the engine
    (their type names, None where none was: ``passed``): one optimizer is needed; a given one wins."""
    passed_optimizer, passed_scheduler = given
    if passed_optimizer is None and optimizer is None:
        raise ConfigError(
            f"{source}: no optimizer",
            "the engine steps an optimizer, and neither the call nor the config provides one",
            'pass optimizer= to SpikingSail/initialize, or add "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}',
        )
    if passed_optimizer is not None and optimizer is not None:
        log.warning(
            "%s: the optimizer passed to the engine is used; the config's optimizer section (%s) is ignored",
            source,
            optimizer.type,
        )
    if passed_scheduler is not None and scheduler is not None:
        log.warning(
            "%s: the lr_scheduler passed to the engine (%s) is used; the config's scheduler section (%s) is ignored",
            source,
            passed_scheduler,
            scheduler.type,
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


def keep_neuron_state_per_rank(module: torch.nn.Module, snn: SpikingSupport) -> None:
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
