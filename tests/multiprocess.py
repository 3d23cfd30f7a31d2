"""Run a function in N real processes with gloo, through torchrun's elastic agent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spikingsail.launchers.spawn import run_processes


def run_ranks(fn: Callable[..., Any], nproc: int, *args: Any) -> dict[int, Any]:
    """``fn(*args)`` on ``nproc`` workers; returns each rank's return value (must be picklable).
    The elastic agent's variables do not stay in this process (the test hygiene check is for
    SpikingSail's side effects); a failed rank raises torchrun's ``ChildFailedError``."""
    return run_processes(fn, nproc, args)


def train_micro_steps(
    engine: Any,
    loader: Any,
    micro_steps: int,
    step: Callable[[Any, Any], None],
    *,
    stop_at: int | None = None,
    checkpoints: str | None = None,
) -> bool:
    """Call ``step(x, y)`` (forward, ``engine.backward``, ``engine.step``) on the loader's batches,
    epoch after epoch, until the engine has made ``micro_steps`` micro-steps. At micro-step
    ``stop_at`` it saves to ``checkpoints``, closes the engine and returns False (the run "dies")."""
    while engine.micro_steps < micro_steps:
        for x, y in loader:
            step(x, y)
            if engine.micro_steps == stop_at:
                assert checkpoints is not None
                engine.save_checkpoint(checkpoints)
                engine.close()
                return False
            if engine.micro_steps == micro_steps:
                break
    return True
