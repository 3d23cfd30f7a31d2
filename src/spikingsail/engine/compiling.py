"""The watch that counts what ``torch.compile`` compiles again once training runs (the backends
compile: ``backends/compiling.py``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from spikingsail.engine.state import StepCounters

log = logging.getLogger(__name__)


class CompileWatch:
    """Counts dynamo's compilations; one at a later optimizer step than this process's first
    compilation is a recompilation (a new shape, a changed Python value or module attribute), which
    costs that step its compile time: each is logged with dynamo's reason and written to the metrics
    file. While dynamo compiles, ``pulse`` is called every ``pulse_seconds`` from a thread: a long
    compilation is progress, not a hang. It costs nothing per step: dynamo calls it when it compiles."""

    def __init__(
        self, counters: StepCounters, report: Callable[[str, str, int], None], rank: int,
        pulse: Callable[[], None] | None = None, pulse_seconds: float = 5.0,
    ) -> None:  # fmt: skip
        from torch._dynamo.callback import callback_handler

        self.counters, self.report, self.rank = counters, report, rank
        self.pulse, self.pulse_seconds = pulse, pulse_seconds
        self.compiles = 0
        self.recompiles = 0
        self.first_step: int | None = None
        """The optimizer step of this process's first compilation (a resumed run's is not 0)."""
        self._compiling: threading.Event | None = None
        self._handler = callback_handler
        callback_handler.register_start_callback(self._started)
        callback_handler.register_end_callback(self._compiled)

    def _started(self, _args: Any) -> None:
        if self.pulse is None:
            return
        self._compiling = done = threading.Event()
        threading.Thread(target=self._pulses, args=(done,), name="sail-compile-pulse", daemon=True).start()

    def _pulses(self, done: threading.Event) -> None:
        assert self.pulse is not None
        while not done.wait(self.pulse_seconds):
            self.pulse()

    def _compiled(self, args: Any) -> None:
        from torch._dynamo.callback import CallbackTrigger

        if self._compiling is not None:
            self._compiling.set()
            self._compiling = None
        if args.callback_trigger is not CallbackTrigger.DYNAMO:
            return  # a deferred backward or an autotuning run: part of a compilation already counted
        self.compiles += 1
        step = self.counters.global_steps
        if self.first_step is None:
            self.first_step = step
        if step <= self.first_step:  # the first step's graphs (graph breaks, accumulation's no_sync)
            return
        self.recompiles += 1
        reason = last_recompile_reason()
        if self.recompiles & (self.recompiles - 1) == 0:  # the 1st, 2nd, 4th, 8th, …: never a flood
            log.warning(
                "rank %d: torch.compile compiled again at step %d (%d time(s) after its first step): %s. "
                "Each costs its step the compile time; a shape that changes between steps is the usual "
                'cause (set "compile": {"dynamic": true}, or keep the shapes fixed, e.g. drop_last)',
                self.rank, step, self.recompiles, reason or "dynamo gave no reason",
            )  # fmt: skip
        self.report("recompile", f"recompilation {self.recompiles}: {reason or 'no reason given'}", step)

    def stats(self) -> dict[str, int]:
        return {"compiles": self.compiles, "recompiles": self.recompiles}

    def close(self) -> None:
        if self._compiled in self._handler.end_callbacks:
            self._handler.remove_end_callback(self._compiled)
        if self._started in self._handler.start_callbacks:
            self._handler.remove_start_callback(self._started)
        if self._compiling is not None:
            self._compiling.set()


def last_recompile_reason() -> str | None:
    """Dynamo's reason for the compilation that is ending (the guard that failed), read from the
    metrics it is gathering (it records them once its callbacks have run); None where this torch
    keeps them elsewhere."""
    from torch._dynamo.utils import get_metrics_context

    metrics = getattr(get_metrics_context(), "_metrics", None)
    return metrics.get("recompile_reason") if isinstance(metrics, dict) else None
