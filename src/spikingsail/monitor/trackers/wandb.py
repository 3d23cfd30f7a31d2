"""wandb: a Weights & Biases run in ``LOG_DIR/wandb``.

Online or offline, the project and the entity are W&B's own settings (``WANDB_MODE=offline``,
``WANDB_PROJECT``, ``WANDB_ENTITY``, ``wandb login`` or ``WANDB_API_KEY``), as in any W&B script;
the project defaults to ``spikingsail`` and the run's name to the log directory's. An offline run is
uploaded later with ``wandb sync LOG_DIR/wandb/offline-run-*``. The console is not captured: the
launcher already relays every rank's output.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from spikingsail.errors import ConfigError


class WandbTracker:
    def __init__(self, log_dir: Path) -> None:
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or "spikingsail",
                name=os.environ.get("WANDB_NAME") or log_dir.resolve().name,
                dir=str(log_dir),
                settings=wandb.Settings(console="off"),
            )
        except (wandb.errors.Error, ValueError) as err:  # no API key, a mode it does not know, ...
            raise ConfigError(
                f'sail.trackers names "wandb", but W&B could not start a run: {err}',
                "online runs need an account (wandb login, or WANDB_API_KEY)",
                "run `wandb login`, or set WANDB_MODE=offline to keep the run on disk and `wandb sync` it later",
            ) from None

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)  # type: ignore[no-untyped-call]

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
