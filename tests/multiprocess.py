"""Run a function in N real processes with gloo, through torchrun's elastic agent."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def run_ranks(fn: Callable[..., Any], nproc: int, *args: Any) -> dict[int, Any]:
    """``fn(*args)`` on ``nproc`` workers; returns each rank's return value (must be picklable)."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    saved = dict(os.environ)
    try:
        results: dict[int, Any] = elastic_launch(config, fn)(*args)
    finally:
        # The elastic agent exports a few variables of its own into this process; the test
        # hygiene check is for SpikingSail's side effects, so put the agent's back.
        os.environ.clear()
        os.environ.update(saved)
    return results


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
