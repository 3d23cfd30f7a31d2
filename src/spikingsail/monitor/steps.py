"""What the engine reports after each optimizer step: a progress bar, log lines, a JSONL file.

Only rank 0 reports. A loss is read back from the device (a synchronisation on GPUs) only on
the steps that print it, or on every step when a metrics file is configured.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class StepRecord:
    step: int
    loss: torch.Tensor | None
    """Mean loss of rank 0's micro-batches in this step (unscaled), still on the device."""
    samples: int
    """Samples consumed by all ranks in this step."""
    lr: float
    loss_scale: float
    skipped: bool


class StepMonitor:
    def __init__(
        self,
        *,
        enabled: bool,
        steps_per_print: int,
        progress_bar: bool,
        metrics_path: str | None,
    ) -> None:
        self.enabled = enabled
        self.steps_per_print = steps_per_print
        self._bar: Any = None
        self._metrics: IO[str] | None = None
        self._last = self._interval_start = time.perf_counter()
        self._total_samples = self._interval_samples = 0
        # A bar redraws itself with carriage returns: on a terminal only, log lines elsewhere.
        if enabled and progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(desc="train", unit="step", dynamic_ncols=True, leave=True, mininterval=0.5)
        if enabled and metrics_path:
            path = Path(metrics_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._metrics = path.open("a", buffering=1)

    def on_step(self, record: StepRecord) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        self._total_samples += record.samples
        self._interval_samples += record.samples
        throughput = record.samples / elapsed if elapsed > 0 else 0.0
        printing = record.step % self.steps_per_print == 0
        if printing:
            span, self._interval_start = now - self._interval_start, now
            throughput = self._interval_samples / span if span > 0 else 0.0
            self._interval_samples = 0
        loss = float(record.loss.item()) if record.loss is not None and (printing or self._metrics) else None
        if self._metrics is not None:
            self._metrics.write(
                json.dumps(
                    {
                        "step": record.step,
                        "loss": loss,
                        "lr": record.lr,
                        "samples": self._total_samples,
                        "samples_per_sec": round(throughput, 3),
                        "loss_scale": record.loss_scale,
                        "skipped": record.skipped,
                        "time": time.time(),
                    }
                )
                + "\n"
            )
        if self._bar is not None:
            self._bar.update(1)
            if printing and loss is not None:
                self._bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{throughput:.0f}", refresh=False)
        elif printing:
            log.info(
                "step %d  loss %s  lr %.3g  %.0f samples/s%s",
                record.step,
                "n/a" if loss is None else f"{loss:.4f}",
                record.lr,
                throughput,
                "  (skipped: fp16 overflow)" if record.skipped else "",
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
