"""Progress, logs and per-step metrics of a training run."""
