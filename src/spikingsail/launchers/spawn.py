"""``spikingsail.spawn``: run a function in N local processes from a notebook or a script.

Seed 002's ``mp.spawn`` example without the four environment variables set by hand: the processes
are started by torchrun's elastic agent (a c10d rendezvous on a free local port), so inside ``fn``
the engine finds its ranks exactly as under ``sail launch``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from spikingsail.errors import LaunchError

T = TypeVar("T")


def spawn(fn: Callable[..., T], nprocs: int, args: tuple[Any, ...] = (), max_restarts: int = 0) -> list[T]:
    """Call ``fn(*args)`` in ``nprocs`` processes; returns their return values in rank order.

    ``fn`` must be importable by name (defined at module level), as for ``multiprocessing``.
    """
    if nprocs < 1:
        raise LaunchError(f"spawn(nprocs={nprocs})", fix="start at least one process")
    try:
        results = run_processes(fn, nprocs, args, max_restarts)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        raise LaunchError(
            f"spawn: rank {rank} of {nprocs} failed (exit code {failure.exitcode})",
            failure.message if isinstance(failure.message, str) else str(failure.message),
            "see the rank's traceback above",
        ) from None
    return [results[rank] for rank in sorted(results)]


def run_processes(
    fn: Callable[..., T],
    nprocs: int,
    args: tuple[Any, ...] = (),
    max_restarts: int = 0,
    start_method: str = "spawn",
) -> dict[int, T]:
    """``fn(*args)`` in ``nprocs`` processes under torchrun's agent; their return values by rank.
    A failed rank raises torchrun's ``ChildFailedError``. ``start_method`` is multiprocessing's:
    ``spawn`` (a fresh interpreter per process, safe with CUDA), or ``forkserver`` (forked from a
    server process that has imported ``multiprocessing.set_forkserver_preload``'s modules once)."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"spawn-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method=start_method,
    )
    saved = dict(os.environ)
    try:
        results: dict[int, T] = elastic_launch(config, fn)(*args)
    finally:
        # The elastic agent exports a few variables into the calling process; keep the caller's.
        os.environ.clear()
        os.environ.update(saved)
    return results
