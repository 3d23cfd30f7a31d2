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
