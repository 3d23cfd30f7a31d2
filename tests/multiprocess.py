"""Run a function in N real processes with gloo, through torchrun's elastic agent.

The workers are forked from a forkserver that has imported torch and spikingsail once, instead of
each starting a fresh interpreter (``spawn``) that imports them again: a two-process launch takes
about 0.3 s instead of 3 s, over hundreds of launches in the suite. A forked worker starts from the
server's environment, not the test's, so each worker takes the environment of the ``run_ranks``
call (``_in_callers_environment``). Nothing before the fork has touched a process group; where
torch sees a GPU the workers are spawned as before, so that no CUDA state can cross a fork.
``spikingsail.spawn`` itself keeps ``spawn`` (tests/launchers/test_spawn.py).
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch

from spikingsail.launchers.spawn import run_processes

# What the workers import anyway. No spiking library: spikingsail looks at sys.modules to tell which
# one a model uses. DeepSpeed is imported by the DeepSpeed backend alone, which is the only part that
# looks for it in sys.modules.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.nn.functional",
    "spikingsail",
    "spikingsail.engine.engine",
    # the engine imports these when it first needs them: torch's optimizers import dynamo (and through
    # it FSDP and DTensor) on construction, and a checkpoint needs torch.distributed.checkpoint
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "tests.multiprocess",
    "tests.frozen",  # last: freezes what the server holds before it forks any rank
]
if importlib.util.find_spec("deepspeed") is not None:  # before tests.multiprocess: its environment
    PRELOAD.insert(-2, "tests.deepspeed_cpu")
multiprocessing.set_forkserver_preload(PRELOAD)

START_METHOD = "spawn" if torch.cuda.is_available() else "forkserver"
_SERVER_ENVIRONMENT = dict(os.environ)
"""In a worker: the environment of the forkserver it was forked from (what this module saw on import)."""


def run_ranks(fn: Callable[..., Any], nproc: int, *args: Any) -> dict[int, Any]:
    """``fn(*args)`` on ``nproc`` workers; returns each rank's return value (must be picklable).
    The elastic agent's variables do not stay in this process (the test hygiene check is for
    SpikingSail's side effects); a failed rank raises torchrun's ``ChildFailedError``."""
    return run_processes(
        _in_callers_environment, nproc, (dict(os.environ), fn, *args), start_method=START_METHOD
    )


def _in_callers_environment(environment: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """In a worker: ``run_ranks``'s caller's environment plus what the agent set for this worker
    (its rank, world size, rendezvous), then ``fn(*args)``."""
    agents = {k: v for k, v in os.environ.items() if _SERVER_ENVIRONMENT.get(k) != v}
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(agents)
    return fn(*args)


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
