"""Experiment trackers for rank 0's metrics (``sail.trackers``, in ``sail.log_dir``).

jsonl        the metrics file, one JSON line per optimizer step (``sail.metrics_path``, by default
             ``LOG_DIR/metrics.jsonl``); what ``sail report`` reads
tensorboard  event files in ``LOG_DIR/tensorboard`` through torch's ``SummaryWriter`` (the
             ``tensorboard`` package: ``pip install spikingsail[trackers]``)
mlflow       a run in the local file store ``LOG_DIR/mlruns`` (``mlflow-skinny``; view it with
             ``mlflow ui --backend-store-uri LOG_DIR/mlruns``)

Each step's scalars are ``train/loss``, ``train/lr``, ``train/loss_scale``, ``train/samples_per_sec``;
at the end of a straggler window ``stragglers/score/rankN`` and ``step_ms/PHASE/rankN``; what the
script passes to ``engine.log`` keeps its own names. The config is logged as hyper-parameters once.
Rank 0 only; everything is flushed at ``engine.close()``, which the preemption exit calls too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

from spikingsail.errors import ConfigError

TRACKERS = ("jsonl", "tensorboard", "mlflow")
_MLFLOW_BATCH = 100  # MLflow takes at most this many params in one call


class Tracker(Protocol):
    def log_hyperparams(self, params: dict[str, Any]) -> None: ...

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


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


class TensorBoardTracker:
    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise _missing("tensorboard", "tensorboard") from err
        self.writer = SummaryWriter(log_dir=str(log_dir / "tensorboard"), flush_secs=30)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        self.writer.add_text("config", "```\n" + json.dumps(params, indent=1) + "\n```")
        # the hyper-parameters plugin's three summaries, in this run's own event file
        for summary in hparams(params, {}):  # type: ignore[no-untyped-call]
            self.writer._get_file_writer().add_summary(summary)  # type: ignore[no-untyped-call]

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class MLflowTracker:
    def __init__(self, log_dir: Path) -> None:
        # MLflow 3 asks file-store users to opt in: the store needs no database and no server
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise _missing("mlflow", "mlflow-skinny") from err
        self.client = MlflowClient(tracking_uri=(log_dir / "mlruns").resolve().as_uri())
        experiment = self.client.get_experiment_by_name("spikingsail")
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment("spikingsail")
        )
        self.run_id = self.client.create_run(experiment_id, run_name=log_dir.resolve().name).info.run_id

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(items), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=items[start : start + _MLFLOW_BATCH])

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in scalars.items()]
        )

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


def _missing(tracker: str, package: str) -> ConfigError:
    return ConfigError(
        f'sail.trackers names "{tracker}", but the {package} package is not installed',
        f"the {tracker} tracker writes through {package}",
        f"pip install {package} (or spikingsail[trackers]), or leave {tracker} out of sail.trackers",
    )


def check_installed(names: tuple[str, ...]) -> None:
    """On every rank, before rank 0 makes the trackers: a missing package stops every rank alike."""
    for name, module, package in (
        ("tensorboard", "tensorboard", "tensorboard"),
        ("mlflow", "mlflow", "mlflow-skinny"),
    ):
        if name in names and not _importable(module):
            raise _missing(name, package)


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
            if name == "tensorboard":
                made.append(TensorBoardTracker(log_dir))
            elif name == "mlflow":
                made.append(MLflowTracker(log_dir))
    except BaseException:
        for tracker in made:
            tracker.close()
        raise
    return made
