"""Trackers read back: TensorBoard's event files, MLflow's file store and an offline W&B run (read
by W&B's own ``wandb leet inspect``) hold what the metrics file holds — loss, lr, loss scale, samples/s, straggler scores, the step breakdown, the script's own
metrics and the config — written by rank 0 of two, and flushed when a preempted run exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

import spikingsail
from spikingsail.errors import ConfigError
from spikingsail.monitor.report import metrics_file, read_run
from tests.multiprocess import run_ranks

STEPS = 12


def job(log_dir: str) -> None:
    os.environ["WANDB_MODE"] = "offline"  # W&B's own switch: no account, the run stays on disk
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    engine, _ = spikingsail.initialize(
        model=net,
        config={"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
                "sail": {"progress_bar": False, "straggler_window": 4, "log_dir": log_dir,
                         "trackers": ["jsonl", "tensorboard", "mlflow", "wandb"]}},
    )  # fmt: skip
    g = torch.Generator().manual_seed(engine.rank)
    for _ in range(STEPS):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
    engine.log({"val/accuracy": torch.tensor(0.75) if engine.rank == 0 else 0.0})
    engine.close()


def jsonl(log_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    lines = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "log" not in line], [line for line in lines if "log" in line]


def tensorboard_scalars(log_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(log_dir / "tensorboard"))
    events.Reload()
    return events


def wandb_records(log_dir: Path) -> list[dict[str, Any]]:
    """The offline run's records, as W&B's own reader prints them (one JSON object per line)."""
    wandb = str(Path(sys.executable).with_name("wandb"))
    (run,) = (log_dir / "wandb").glob("offline-run-*")
    shown = subprocess.run(
        [wandb, "leet", "inspect", "--json", str(run)], capture_output=True, text=True, check=True
    )
    return [json.loads(line) for line in shown.stdout.splitlines()]


def mlflow_run(log_dir: Path) -> tuple[MlflowClient, Any]:
    client = MlflowClient(tracking_uri=(log_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("spikingsail")
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


@pytest.mark.multiprocess
def test_every_tracker_holds_the_metrics_files_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this process's reader
    log_dir = tmp_path / "run"
    run_ranks(job, 2, str(log_dir))
    steps, logs = jsonl(log_dir)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert logs == [{"step": STEPS, "log": {"val/accuracy": 0.75}, "time": logs[0]["time"]}]
    windows = [s for s in steps if "stragglers" in s]
    assert [w["step"] for w in windows] == [4, 8, 12]
    run = read_run(metrics_file(log_dir))  # sail report reads the run's directory, engine.log's line aside
    assert [s["step"] for s in run.steps] == list(range(1, STEPS + 1))

    events = tensorboard_scalars(log_dir)
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, STEPS + 1))
    assert [e.value for e in loss] == pytest.approx([s["loss"] for s in steps], rel=1e-6)
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([0.05] * STEPS)
    assert len(events.Scalars("train/samples_per_sec")) == STEPS
    assert len(events.Scalars("train/loss_scale")) == STEPS
    for rank in (0, 1):
        scores = events.Scalars(f"stragglers/score/rank{rank}")
        assert [(e.step, e.value) for e in scores] == [
            (w["step"], pytest.approx(w["stragglers"]["scores"][rank], rel=1e-6)) for w in windows
        ]
        forward = events.Scalars(f"step_ms/forward/rank{rank}")
        assert [e.value for e in forward] == pytest.approx(
            [w["stragglers"]["ms_per_step"]["forward"][rank] for w in windows], rel=1e-5
        )
    assert [(e.step, e.value) for e in events.Scalars("val/accuracy")] == [(STEPS, 0.75)]
    assert "config/text_summary" in events.Tags()["tensors"]
    hparams = HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    )
    logged = hparams.session_start_info.hparams
    assert logged["train_micro_batch_size_per_gpu"].number_value == 4
    assert logged["optimizer.params.lr"].number_value == pytest.approx(0.05)
    assert logged["sail.trackers"].string_value == '["jsonl", "tensorboard", "mlflow", "wandb"]'

    client, run = mlflow_run(log_dir)
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(s["step"], pytest.approx(s["loss"])) for s in steps]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "stragglers/score/rank1")] == [
        pytest.approx(w["stragglers"]["scores"][1]) for w in windows
    ]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val/accuracy")] == [
        (STEPS, 0.75)
    ]
    params = run.data.params
    assert params["train_micro_batch_size_per_gpu"] == "4"
    assert params["optimizer.params.lr"] == "0.05"
    assert params["sail.trackers"] == '["jsonl", "tensorboard", "mlflow", "wandb"]'

    records = wandb_records(log_dir)
    history = [r["history"] for r in records if r["type"] == "history"]
    loss = [(h["step"]["num"], h["item"]["train/loss"]) for h in history if "train/loss" in h["item"]]
    assert loss == [(s["step"], pytest.approx(s["loss"], rel=1e-6)) for s in steps]
    assert [
        h["item"]["stragglers/score/rank1"] for h in history if "stragglers/score/rank1" in h["item"]
    ] == [pytest.approx(w["stragglers"]["scores"][1], rel=1e-6) for w in windows]
    assert [
        (h["step"]["num"], h["item"]["val/accuracy"]) for h in history if "val/accuracy" in h["item"]
    ] == [(STEPS, 0.75)]
    config = {k: v for r in records if r["type"] == "config" for k, v in r["config"]["update"].items()}
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert config["optimizer.params.lr"] == pytest.approx(0.05)
    (run,) = (r["run"] for r in records if r["type"] == "run")
    assert (run["project"], run["display_name"]) == ("spikingsail", "run")
    assert any(r["type"] == "exit" for r in records), "the run was finished"


def test_a_preempted_run_has_flushed_its_trackers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    script = tmp_path / "preempted.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, torch, torch.nn.functional as F, spikingsail
        net = torch.nn.Linear(4, 2)
        engine, _ = spikingsail.initialize(model=net, config={{
            "train_micro_batch_size_per_gpu": 2, "optimizer": {{"type": "SGD", "params": {{"lr": 0.1}}}},
            "checkpoint": {{"path": {str(tmp_path / "ckpt")!r}}},
            "sail": {{"progress_bar": False, "log_dir": {str(tmp_path / "run")!r},
                     "trackers": ["tensorboard", "mlflow", "wandb"]}}}})
        for step in range(100):
            if step == 7:
                os.kill(os.getpid(), signal.SIGUSR1)
            engine.backward(F.cross_entropy(engine(torch.randn(2, 4)), torch.tensor([0, 1])))
            engine.step()
    """))  # fmt: skip
    environ = {**os.environ, "WANDB_MODE": "offline"}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=environ
    )
    assert result.returncode == 75, result.stderr[-2000:]
    events = tensorboard_scalars(tmp_path / "run")
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 9))
    client, run = mlflow_run(tmp_path / "run")
    assert run.info.status == "FINISHED"
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 8
    records = wandb_records(tmp_path / "run")
    assert [r["history"]["step"]["num"] for r in records if r["type"] == "history"] == list(range(1, 9))
    assert any(r["type"] == "exit" for r in records)
    assert signal.SIGUSR1  # the signal the script sent itself


@pytest.mark.parametrize(("tracker", "package"), [("mlflow", "mlflow-skinny"), ("wandb", "wandb")])
def test_a_tracker_without_its_package_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tracker: str, package: str
) -> None:
    monkeypatch.setitem(sys.modules, tracker, None)  # what Python does for a module it must not import
    with pytest.raises(
        ConfigError, match=rf'sail.trackers names "{tracker}", but the {package} package is not installed'
    ):
        spikingsail.initialize(
            model=torch.nn.Linear(2, 2),
            config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                    "sail": {"trackers": [tracker], "log_dir": str(tmp_path)}},
        )  # fmt: skip
    assert not list(tmp_path.iterdir())


def test_an_unknown_tracker_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"sail.trackers\[1\] is 'neptune'"):
        spikingsail.load_config({"sail": {"trackers": ["jsonl", "neptune"]}}, world_size=1)


def test_an_online_wandb_run_without_an_account_is_refused_before_training(tmp_path: Path) -> None:
    script = tmp_path / "online.py"
    script.write_text(textwrap.dedent(f"""
        import torch, spikingsail
        spikingsail.initialize(model=torch.nn.Linear(2, 2), config={{
            "train_micro_batch_size_per_gpu": 1, "optimizer": {{"type": "SGD", "params": {{"lr": 0.1}}}},
            "sail": {{"progress_bar": False, "trackers": ["wandb"], "log_dir": {str(tmp_path / "run")!r}}}}})
        print("trained")
    """))  # fmt: skip
    # W&B's default mode (online), and no account: no WANDB_API_KEY, no ~/.netrc
    environ = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {"HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                            env=environ, stdin=subprocess.DEVNULL)  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert "trained" not in result.stdout
    assert (
        'sail.trackers names "wandb", but W&B could not start a run: No API key configured' in result.stderr
    )
    assert "fix: run `wandb login`, or set WANDB_MODE=offline" in result.stderr
