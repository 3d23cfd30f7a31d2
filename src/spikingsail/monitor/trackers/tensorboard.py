"""tensorboard: event files in ``LOG_DIR/tensorboard`` through torch's ``SummaryWriter``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class TensorBoardTracker:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

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
