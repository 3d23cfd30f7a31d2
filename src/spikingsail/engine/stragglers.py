"""Where each rank's step time goes, and which rank holds the others up (``sail.straggler_window``).

Each rank marks the engine's own phases with timestamps (CUDA events on a GPU, where the host runs
ahead of the kernels):

data       from the end of one engine call to the next forward: the script's loop, the batch loading
forward    ``engine(batch)``
backward   ``engine.backward(loss)`` up to this rank's last gradient
comm       the rest of backward: the wait for the other ranks' gradients (DDP's and Horovod's
           all-reduce end there)
optimizer  ``engine.step()``

Every ``window`` optimizer steps the ranks sum their phases in one small all-reduce at the step
boundary (never inside a phase), and each rank's score is its own work (every phase but comm)
over the median of the other ranks' work. A rank whose score stays at or above ``factor`` for
three windows in a row is a straggler: rank 0 warns once, naming its rank and host, until it recovers.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from spikingsail.engine.timing import Clock, LastGradient

log = logging.getLogger(__name__)

PHASES = ("data", "forward", "backward", "comm", "optimizer")
_WORK = [i for i, phase in enumerate(PHASES) if phase != "comm"]
PERSISTENT_WINDOWS = 3


class StragglerWatch:
    def __init__(
        self, model: nn.Module, device: torch.device, *, world_size: int, window: int, factor: float
    ) -> None:
        self.clock = Clock(device.type == "cuda")
        self.world_size = world_size
        self.window = window
        self.factor = factor
        self._spans: list[tuple[int, Any, Any]] = []  # (phase, start, end), resolved at the window's end
        self._last_end: Any = None
        self._steps = 0
        self._above = [0] * world_size
        self._warned: set[int] = set()
        self.hosts: list[str] | None = None
        self.last_gradient = LastGradient(model, self.clock)

    def _span(self, phase: str, start: Any, end: Any) -> None:
        self._spans.append((PHASES.index(phase), start, end))

    def forward_begins(self) -> Any:
        now = self.clock.mark()
        if self._last_end is not None:
            self._span("data", self._last_end, now)
        return now

    def forward_ends(self, start: Any) -> None:
        self._last_end = self.clock.mark()
        self._span("forward", start, self._last_end)

    def backward_begins(self) -> Any:
        self.last_gradient.begin()
        return self.clock.mark()

    def backward_ends(self, start: Any) -> None:
        last = self.last_gradient.end()
        end = self.clock.mark()
        if last is None:  # nothing needed a gradient: no wait to tell apart
            self._span("backward", start, end)
        else:
            self._span("backward", start, last)
            self._span("comm", last, end)
        self._last_end = end

    def optimizer_begins(self) -> Any:
        return self.clock.mark()

    def optimizer_ends(self, start: Any) -> None:
        self._last_end = self.clock.mark()
        self._span("optimizer", start, self._last_end)

    def after_step(
        self,
        step: int,
        rank: int,
        all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
        hosts: Callable[[], list[str]],
    ) -> dict[str, Any] | None:
        """At an optimizer-step boundary, on every rank alike: at a window's end, the ranks'
        breakdown (seconds per phase, summed over the window) and scores; None in between."""
        self._steps += 1
        if self._steps % self.window:
            return None
        totals = [0.0] * len(PHASES)
        for phase, start, end in self._spans:
            totals[phase] += self.clock.seconds(start, end)
        self._spans.clear()
        mine = torch.zeros(self.world_size, len(PHASES), dtype=torch.float64)
        mine[rank] = torch.tensor(totals, dtype=torch.float64)
        if self.hosts is None:
            self.hosts = hosts()  # a collective: every rank asks at the same window
        times = all_reduce_sum(mine)
        self._last_end = self.clock.mark()  # the all-reduce's wait for the slowest rank is no data wait
        work = times[:, _WORK].sum(1).tolist()
        scores = []
        for r, own in enumerate(work):
            others = statistics.median(work[:r] + work[r + 1 :])
            scores.append(round(own / others, 3) if others > 0 else 1.0)
        self._judge(step, rank, scores, times)
        return {
            "window": self.window,
            "scores": scores,
            "ms_per_step": {
                p: [round(1000 * float(t) / self.window, 3) for t in times[:, i]]
                for i, p in enumerate(PHASES)
            },
        }

    def _judge(self, step: int, rank: int, scores: list[float], times: torch.Tensor) -> None:
        for r, score in enumerate(scores):
            self._above[r] = self._above[r] + 1 if score >= self.factor else 0
            if self._above[r] < PERSISTENT_WINDOWS:
                self._warned.discard(r)
                continue
            if r in self._warned or rank != 0:
                continue
            self._warned.add(r)
            assert self.hosts is not None
            per_step = {
                p: 1000 * float(times[r, i]) / self.window for i, p in enumerate(PHASES) if p != "comm"
            }
            log.warning(
                "straggler: rank %d on %s has taken %.2f× the other ranks' (median) time per step for the last %d "
                "steps (to step %d; data %.1f ms, forward %.1f ms, backward %.1f ms, optimizer %.1f ms); "
                "every rank waits for it at each all-reduce — check that host's load, GPU clocks and "
                "data loading, or give it a smaller share with sail.balance",
                r, self.hosts[r], score, PERSISTENT_WINDOWS * self.window, step, per_step["data"],
                per_step["forward"], per_step["backward"], per_step["optimizer"],
            )  # fmt: skip

    def close(self) -> None:
        self.last_gradient.remove()
