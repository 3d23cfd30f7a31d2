"""What the engine reports after optimizer steps: a progress bar, log lines, a JSONL file.

Only rank 0 reports, through the engine's step hooks (``engine/hooks.py``): at the steps it reports
(``period_end``), so a step that reports nothing costs no call (one, with gradient accumulation,
which keeps the micro-batches' losses of the steps it will report); a loss is read back from the
device (a synchronisation on GPUs) only on the steps that print it, or on every step when a metrics
file is configured.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from spikingsail.monitor.trackers import Tracker

if TYPE_CHECKING:
    from spikingsail.engine.hooks import StepNotes

log = logging.getLogger(__name__)
_PROGRESS = "step %d  loss %s  lr %.3g  %.0f samples/s%s%s"


@dataclass(kw_only=True, slots=True)
class StepRecord:
    step: int
    loss: torch.Tensor | None
    """Mean loss of rank 0's micro-batches in this step (unscaled), still on the device."""
    lr: float
    loss_scale: float
    skipped: bool
    balance: dict[str, Any] | None = None
    """A new split of the global micro-batch (``sail.balance: auto``) made at this step."""
    stragglers: dict[str, Any] | None = None
    """The ranks' step-time breakdown and scores, at the end of a straggler window."""


class StepMonitor:
    def __init__(
        self,
        *,
        enabled: bool,
        samples_per_step: int,
        steps_per_print: int,
        progress_bar: bool,
        metrics_path: str | None,
        trackers: list[Tracker] | None = None,
    ) -> None:
        self.enabled = enabled
        self.samples_per_step = samples_per_step
        self.steps_per_print = steps_per_print
        self._bar: Any = None
        self._metrics: IO[str] | None = None
        self._last_time = self._print_time = time.perf_counter()
        self._print_step = 0
        self._slowest = ""  # the slowest rank and its score, from the last straggler window
        # A bar redraws itself with carriage returns: on a terminal only, log lines elsewhere.
        if enabled and progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(desc="train", unit="step", dynamic_ncols=True, leave=True, mininterval=0.5)
        if enabled and metrics_path:
            path = Path(metrics_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._metrics = path.open("a", buffering=1)
        self.trackers = trackers or []
        every_step = self._bar is not None or self._metrics is not None or bool(self.trackers)
        self.period = 1 if every_step else steps_per_print
        """A record at every ``period``-th optimizer step (``period_end``): each step where a bar,
        a metrics file or a tracker takes them."""
        self._lr: Callable[[], float] = lambda: 0.0
        self._loss_scale: Callable[[], float] = lambda: 1.0

    def attach(self, *, lr: Callable[[], float], loss_scale: Callable[[], float]) -> None:
        """What the records read from the engine: the learning rate and the loss scale."""
        self._lr, self._loss_scale = lr, loss_scale

    # The engine's step hooks, registered on rank 0 only: a record at every ``period``-th step.
    # Without accumulation a step's loss is the one its notes carry; ``AccumulatedLossMonitor``
    # keeps the micro-batches' losses.

    def period_end(self, notes: StepNotes) -> None:
        self.on_step(StepRecord(
            step=notes.step, loss=self._step_loss(notes), lr=self._lr(), loss_scale=self._loss_scale(),
            skipped=notes.skipped, balance=notes.balance, stragglers=notes.stragglers,
        ))  # fmt: skip

    def _step_loss(self, notes: StepNotes) -> torch.Tensor | None:
        return None if notes.loss is None else notes.loss.float()

    def on_step(self, record: StepRecord) -> None:
        now = time.perf_counter()
        printing = record.step % self.steps_per_print == 0
        recording = self._metrics is not None or bool(self.trackers)
        loss = float(record.loss.item()) if record.loss is not None and (printing or recording) else None
        if recording:
            samples_per_sec = self.samples_per_step / max(now - self._last_time, 1e-9)
            if self._metrics is not None:
                self._write_metrics(record, loss, samples_per_sec)
            if self.trackers:
                scalars = _scalars(record, loss, samples_per_sec)
                for tracker in self.trackers:
                    tracker.log(scalars, record.step)
        self._last_time = now
        if record.stragglers is not None:
            scores = record.stragglers["scores"]
            slowest = max(range(len(scores)), key=scores.__getitem__)
            self._slowest = f"r{slowest} ×{scores[slowest]:.2f}"
        if not printing:
            if self._bar is not None:
                self._bar.update(1)
            return
        steps, self._print_step = record.step - self._print_step, record.step
        span, self._print_time = now - self._print_time, now
        throughput = steps * self.samples_per_step / max(span, 1e-9)
        if self._bar is not None:
            self._bar.update(1)
            if loss is not None:
                extra = {"slowest": self._slowest} if self._slowest else {}
                self._bar.set_postfix(
                    loss=f"{loss:.4f}", samples_per_s=f"{throughput:.0f}", **extra, refresh=False
                )
            return
        if log.isEnabledFor(logging.INFO):
            # the record logging.info would make, less its search of the stack for the calling line
            # (most of what a line costs): it names this function, at line 0
            args = (
                record.step,
                "n/a" if loss is None else f"{loss:.4f}",
                record.lr,
                throughput,
                f"  slowest {self._slowest}" if self._slowest else "",
                "  (skipped: fp16 overflow)" if record.skipped else "",
            )
            line = log.makeRecord(log.name, logging.INFO, __file__, 0, _PROGRESS, args, None, "on_step")
            log.handle(line)

    def _write_metrics(self, record: StepRecord, loss: float | None, throughput: float) -> None:
        assert self._metrics is not None
        line: dict[str, Any] = {
            "step": record.step,
            "loss": loss,
            "lr": record.lr,
            "samples": record.step * self.samples_per_step,
            "samples_per_sec": round(throughput, 3),
            "loss_scale": record.loss_scale,
            "skipped": record.skipped,
            "time": time.time(),
        }
        if record.balance is not None:
            line["balance"] = {"speeds": record.balance["speeds"], "split": record.balance["split"]}
            if record.balance.get("probed"):
                line["balance"]["probed"] = True  # kept for its steps' time, not from the speeds
        if record.stragglers is not None:
            line["stragglers"] = record.stragglers
        self._metrics.write(json.dumps(line) + "\n")

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log_hyperparams(params)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """The script's own metrics (``engine.log``): to every tracker, and as a line of the
        metrics file of their own (``{"step": N, "log": {...}}``)."""
        if not self.enabled:
            return
        if self._metrics is not None:
            self._metrics.write(json.dumps({"step": step, "log": metrics, "time": time.time()}) + "\n")
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def event(self, kind: str, message: str, step: int) -> None:
        """Something that happened to the run (a failed save): a line of the metrics file of its own
        (``{"step": N, "event": kind, "message": ...}``)."""
        if self.enabled and self._metrics is not None:
            line = {"step": step, "event": kind, "message": message, "time": time.time()}
            self._metrics.write(json.dumps(line) + "\n")

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            try:
                tracker.close()
            except Exception as err:  # one tracker failing to flush must not lose the others
                log.error("closing the %s tracker failed: %s", type(tracker).__name__, err)
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


class AccumulatedLossMonitor(StepMonitor):
    """The monitor of a run with gradient accumulation: a step's loss is the mean of its
    micro-batches', kept at each backward of the steps it reports."""

    def __init__(self, *, accumulation: int, **monitor: Any) -> None:
        super().__init__(**monitor)
        self._accumulation = accumulation
        self._losses: list[torch.Tensor] = []
        self._kept: list[torch.Tensor] = []  # the losses of the step that just ended
        self._recording = self.period == 1  # whether the first step is reported

    def backward_begin(self, loss: torch.Tensor, _boundary: bool) -> None:
        if self._recording:
            self._losses.append(loss.detach() / self._accumulation)

    def discarded(self) -> None:
        self._losses = []

    def optimizer_end(self, notes: StepNotes) -> None:
        self._kept, self._losses = self._losses, []
        self._recording = (notes.step + 1) % self.period == 0

    def _step_loss(self, notes: StepNotes) -> torch.Tensor | None:
        return torch.stack(self._kept).float().sum() if self._kept else None


def _scalars(record: StepRecord, loss: float | None, samples_per_sec: float) -> dict[str, float]:
    scalars = {
        "train/lr": record.lr,
        "train/loss_scale": record.loss_scale,
        "train/samples_per_sec": samples_per_sec,
    }
    if loss is not None:
        scalars["train/loss"] = loss
    if record.stragglers is not None:
        for rank, score in enumerate(record.stragglers["scores"]):
            scalars[f"stragglers/score/rank{rank}"] = score
        for phase, per_rank in record.stragglers["ms_per_step"].items():
            for rank, ms in enumerate(per_rank):
                scalars[f"step_ms/{phase}/rank{rank}"] = ms
    return scalars
