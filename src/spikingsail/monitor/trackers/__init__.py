"""Experiment trackers for rank 0's metrics (``sail.trackers``, in ``sail.log_dir``), by name.

jsonl        the metrics file, one JSON line per optimizer step (``sail.metrics_path``, by default
             ``LOG_DIR/metrics.jsonl``); what ``sail report`` reads
tensorboard  event files in ``LOG_DIR/tensorboard`` through torch's ``SummaryWriter`` (the
             ``tensorboard`` package: ``pip install spikingsail[trackers]``)
mlflow       a run in the local file store ``LOG_DIR/mlruns`` (``mlflow-skinny``; view it with
             ``mlflow ui --backend-store-uri LOG_DIR/mlruns``)
wandb        a Weights & Biases run in ``LOG_DIR/wandb``, online or offline as W&B's own settings
             say (``WANDB_MODE``, ``WANDB_PROJECT``, ``WANDB_ENTITY``; ``wandb login`` for online)

Each step's scalars are ``train/loss``, ``train/lr``, ``train/loss_scale``, ``train/samples_per_sec``;
at the end of a straggler window ``stragglers/score/rankN`` and ``step_ms/PHASE/rankN``; what the
script passes to ``engine.log`` keeps its own names. The config is logged as hyper-parameters once.
Rank 0 only; everything is flushed at ``engine.close()``, which the preemption exit calls too.

A tracker is a module of this package with a class that has the three methods of ``Tracker`` and
takes the log directory, and a line in ``REGISTRY``; its package is imported only when chosen.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from spikingsail.errors import ConfigError


class Tracker(Protocol):
    def log_hyperparams(self, params: dict[str, Any]) -> None: ...

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Registered:
    target: str | None
    """The tracker's class as "module:Class"; None for jsonl, the metrics file the engine writes anyway."""
    module: str = ""
    """What must be importable for it (checked on every rank before the first step)."""
    package: str = ""
    """What ``pip install`` gives it."""


REGISTRY: dict[str, Registered] = {
    "jsonl": Registered(None),
    "tensorboard": Registered(f"{__name__}.tensorboard:TensorBoardTracker", "tensorboard", "tensorboard"),
    "mlflow": Registered(f"{__name__}.mlflow:MLflowTracker", "mlflow", "mlflow-skinny"),
    "wandb": Registered(f"{__name__}.wandb:WandbTracker", "wandb", "wandb"),
}
TRACKERS = tuple(REGISTRY)
"""The names ``sail.trackers`` accepts."""


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``; lists and None as JSON text."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = json.dumps(value)
    return out


def _missing(tracker: str, package: str) -> ConfigError:
    return ConfigError(
        f'sail.trackers names "{tracker}", but the {package} package is not installed',
        f"the {tracker} tracker writes through {package}",
        f"pip install {package} (or spikingsail[trackers]), or leave {tracker} out of sail.trackers",
    )


def check_installed(names: tuple[str, ...]) -> None:
    """On every rank, before rank 0 makes the trackers: a missing package stops every rank alike."""
    for name in names:
        registered = REGISTRY[name]
        if registered.module and not _importable(registered.module):
            raise _missing(name, registered.package)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # None in sys.modules: imports of it are blocked
        return False


def make_trackers(names: tuple[str, ...], log_dir: Path) -> list[Tracker]:
    """The trackers other than jsonl (which is the metrics file)."""
    made: list[Tracker] = []
    try:
        for name in names:
            target = REGISTRY[name].target
            if target is None:
                continue
            module, _, cls = target.partition(":")
            made.append(getattr(importlib.import_module(module), cls)(log_dir))
    except BaseException:
        for tracker in made:
            tracker.close()
        raise
    return made
