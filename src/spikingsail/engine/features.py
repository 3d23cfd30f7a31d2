"""Where the engine's optional features are made from the config, each with what closes it: the hang
watch's heartbeat, the monitor and its trackers, the straggler breakdown, fp16's overflow warning,
torch.compile's recompilation watch. Each is given its own section (``sail``, ``compile``); the
monitor the whole config, whose batch sizes and values it reports.
The engine adds the ones that are on to its step hooks (``engine/hooks.py``) and their closing to
its close stack."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from spikingsail.backends.base import Backend
from spikingsail.backends.process_group import rank_hosts
from spikingsail.config.compiling import CompileConfig
from spikingsail.config.schema import SailConfig, SailSection
from spikingsail.engine.compiling import CompileWatch
from spikingsail.engine.hooks import StepNotes
from spikingsail.engine.state import StepCounters
from spikingsail.engine.stragglers import StragglerWatch
from spikingsail.environments import RankInfo
from spikingsail.monitor import heartbeat
from spikingsail.monitor.heartbeat import Heartbeat, NoHeartbeat
from spikingsail.monitor.ledger import SampleLedger, attempt_id
from spikingsail.monitor.steps import AccumulatedLossMonitor, StepMonitor
from spikingsail.monitor.trackers import check_installed, flatten, make_trackers

if TYPE_CHECKING:
    from spikingsail.engine.replicas import ReplicaEnv

log = logging.getLogger(__name__)


class Overflows:
    """fp16: a warning for each optimizer step that a gradient overflow skipped."""

    def __init__(self, loss_scale: Callable[[], float]) -> None:
        self.loss_scale = loss_scale

    def optimizer_end(self, notes: StepNotes) -> None:
        if notes.skipped:
            log.warning(
                "fp16 overflow: step %d skipped, loss scale now %g", notes.step - 1, self.loss_scale()
            )


def run_directory(sail: SailSection) -> Path:
    """The run's directory (``sail.log_dir``): with trackers and none set, ``runs/DATE-TIME``; else
    beside the metrics file, or the working directory (where a hang report goes)."""
    if sail.log_dir is not None:
        return Path(sail.log_dir)
    if sail.trackers:
        return Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    return Path(sail.metrics_path).parent if sail.metrics_path else Path.cwd()


def hang_watch(
    sail: SailSection, rank_info: RankInfo, counters: StepCounters, log_dir: Path, closing: ExitStack
) -> Heartbeat | NoHeartbeat:
    """This rank's progress records and its node's hang watch (``sail.hang_timeout_seconds``);
    ``NoHeartbeat`` when off (a single process, or a timeout of 0). Collective when on."""
    world_size = rank_info.world_size
    if not (sail.hang_timeout_seconds and world_size > 1 and dist.is_initialized()):
        return NoHeartbeat()
    if not heartbeat.AVAILABLE:
        if rank_info.is_rank_zero:
            log.warning("sail.hang_timeout_seconds: the hang watch needs Linux (memfd_create and /proc); "
                        "it is off here (%s)", sys.platform)  # fmt: skip
        return NoHeartbeat()
    if sail.hang_timeout_seconds >= 60 * sail.timeout_minutes and rank_info.is_rank_zero:
        log.warning("sail.hang_timeout_seconds (%g) is not below sail.timeout_minutes (%g min): a hung "
                    "collective times out before the hang watch can report who holds it up",
                    sail.hang_timeout_seconds, sail.timeout_minutes)  # fmt: skip
    beat, watch = heartbeat.start(
        rank=rank_info.rank, world_size=world_size, timeout=sail.hang_timeout_seconds,
        report_dir=str(log_dir.resolve()), board_host=os.environ.get("MASTER_ADDR"),
    )  # fmt: skip
    closing.callback(heartbeat.stop, watch)
    closing.callback(beat.close)
    beat.counters = counters
    return beat


def monitor(config: SailConfig, rank_info: RankInfo, log_dir: Path, closing: ExitStack) -> StepMonitor:
    """Rank 0's progress bar, metrics file and trackers (``sail.trackers`` in ``log_dir``)."""
    sail, zero = config.sail, rank_info.is_rank_zero
    metrics_path = sail.metrics_path
    if metrics_path is None and "jsonl" in sail.trackers:
        metrics_path = str(log_dir / "metrics.jsonl")
    check_installed(sail.trackers)
    made = make_trackers(sail.trackers, log_dir) if zero and sail.trackers else []
    options: dict[str, Any] = {
        "enabled": zero,
        "samples_per_step": config.train_batch_size,
        "steps_per_print": config.steps_per_print,
        "progress_bar": sail.progress_bar,
        "metrics_path": metrics_path,
        "trackers": made,
    }
    accumulation = config.gradient_accumulation_steps
    steps = (
        StepMonitor(**options)
        if accumulation == 1
        else AccumulatedLossMonitor(accumulation=accumulation, **options)
    )
    closing.callback(steps.close)
    steps.log_hyperparams(flatten(config.raw))
    return steps


def ledger(
    sail: SailSection, rank_info: RankInfo, backend: Backend, log_dir: Path, replica_env: ReplicaEnv | None,
    counters: StepCounters, closing: ExitStack,
) -> SampleLedger | None:  # fmt: skip
    """This process's sample ledger (``sail.ledger``; None when off). Collective when on: the ranks
    agree on the attempt's id. With replica groups the header names the group and the job (a digest
    of the job's secret: torchft's quorum ids count from 1 again in every job)."""
    if not sail.ledger:
        return None
    distributed = rank_info.world_size > 1 and dist.is_initialized()
    attempt = attempt_id(backend.all_reduce_sum if distributed else None, rank_info.rank)
    shard = backend.data_parallel
    facts: dict[str, Any] = {"rank": rank_info.rank, "world_size": rank_info.world_size,
                             "group": None if replica_env is None else replica_env.group,
                             "dp_rank": shard.rank, "dp_size": shard.size}  # fmt: skip
    if replica_env is not None:
        facts["job"] = hashlib.sha256(replica_env.secret).hexdigest()[:16]
    made = SampleLedger(log_dir, attempt, facts, lambda: counters.global_steps)
    closing.callback(made.close)
    return made


def straggler_watch(
    sail: SailSection, rank_info: RankInfo, model: torch.nn.Module, device: torch.device, backend: Backend,
    closing: ExitStack,
) -> StragglerWatch | None:  # fmt: skip
    """The step-time breakdown of ``sail.straggler_window`` (None when off, or for a single process)."""
    if not (sail.straggler_window and rank_info.world_size > 1 and dist.is_initialized()):
        return None
    watch = StragglerWatch(
        model, device, rank=rank_info.rank, world_size=rank_info.world_size, window=sail.straggler_window,
        factor=sail.straggler_factor, all_reduce_sum=backend.all_reduce_sum,
        hosts=lambda: rank_hosts(rank_info.world_size),
    )  # fmt: skip
    closing.callback(watch.close)
    return watch


def compiled(
    settings: CompileConfig, hang_timeout: float, backend: Backend, wrapped: torch.nn.Module, model: torch.nn.Module,
    counters: StepCounters, report: Callable[[str, str, int], None], rank: int,
    beat: Heartbeat | NoHeartbeat, closing: ExitStack,
) -> CompileWatch | None:  # fmt: skip
    """torch.compile as the ``compile`` section says, and the watch of its recompilations (None when
    off), which keeps the hang watch's record beating while dynamo compiles: a pulse every tenth of
    ``hang_timeout`` (``sail.hang_timeout_seconds``), 0.5 s apart at least. Dynamo compiles at the
    first forward."""
    if not settings.enabled:
        return None
    pulse = beat.pulse if isinstance(beat, Heartbeat) else None
    watch = CompileWatch(counters, report, rank, pulse, max(0.5, hang_timeout / 10))
    closing.callback(watch.close)
    backend.compile(wrapped, model, settings)
    return watch
