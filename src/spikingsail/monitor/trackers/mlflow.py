"""mlflow: a run of experiment ``spikingsail`` in the local file store ``LOG_DIR/mlruns`` (mlflow-skinny)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

_BATCH = 100  # MLflow takes at most this many params in one call


class MLflowTracker:
    def __init__(self, log_dir: Path) -> None:
        # MLflow 3 asks file-store users to opt in: the store needs no database and no server
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=(log_dir / "mlruns").resolve().as_uri())
        experiment = self.client.get_experiment_by_name("spikingsail")
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment("spikingsail")
        )
        self.run_id = self.client.create_run(experiment_id, run_name=log_dir.resolve().name).info.run_id

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(items), _BATCH):
            self.client.log_batch(self.run_id, params=items[start : start + _BATCH])

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in scalars.items()]
        )

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")
