"""``sail report`` on what a real run writes besides steps (a failed save's event), and on lines of
other shapes: a summary, or one message naming the line, never a traceback; ``--out`` never
replaces a file."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

import spikingsail
from spikingsail.cli.main import main

STEP = {"step": 1, "loss": 2.0, "lr": 0.1, "samples": 8, "samples_per_sec": 100.0, "loss_scale": 1.0,
        "skipped": False, "time": 0.0}  # fmt: skip
WINDOW = {"window": 2, "scores": [1.0, 1.5], "ms_per_step": {"data": [1.0, 2.0], "forward": [3.0, 4.0]}}


def report(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["report", *argv])
    return code, out.getvalue(), err.getvalue()


def test_a_run_whose_save_failed_is_summarised_with_the_event(tmp_path: Path) -> None:
    checkpoints, metrics = tmp_path / "ck", tmp_path / "run" / "metrics.jsonl"
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "checkpoint": {"path": str(checkpoints), "interval_steps": 2, "on_error": "continue"},
              "sail": {"progress_bar": False, "metrics_path": str(metrics)}}  # fmt: skip
    engine, _ = spikingsail.initialize(model=torch.nn.Linear(3, 2), config=config)
    for step in range(1, 5):
        if step == 3:
            shutil.rmtree(checkpoints)  # the save at the last step fails: the directory vanished
        engine.backward(engine(torch.ones(2, 3)).sum())
        engine.step()
    engine.close()
    assert '"event": "checkpoint_failed"' in metrics.read_text()
    code, out, err = report(str(metrics), "--out", str(tmp_path / "plots"))
    assert code == 0, err
    assert "events        : 1 checkpoint_failed (the last at step 4)" in out, out
    assert "steps         : 1 to 4 (4 recorded)" in out
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["loss.png", "lr.png", "throughput.png"]


BAD_LINES = {
    "empty scores": (
        {**STEP, "stragglers": {**WINDOW, "scores": []}},
        """'stragglers' is {"window": 2, "scores": [], "ms_per_step": {"data": [1.0,..., without a score""",
    ),
    "a string loss": ({**STEP, "loss": "0.5"}, "'loss' is \"0.5\", not a number"),
    "a string speed": ({**STEP, "samples_per_sec": "fast"}, "'samples_per_sec' is \"fast\", not a number"),
    "a string step": ({**STEP, "step": "1"}, "'step' is \"1\", not a step number"),
    "a short phase": (
        {**STEP, "stragglers": {**WINDOW, "ms_per_step": {"data": [1.0]}}},
        "'stragglers.ms_per_step.data' is [1.0], not one number per rank (2)",
    ),
    "a huge integer": ({**STEP, "lr": 10**30}, "'lr' is 1000000000000000000000000000000, not a number"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_a_line_of_another_shape_is_named(tmp_path: Path, case: str) -> None:
    line, words = BAD_LINES[case]
    (tmp_path / "metrics.jsonl").write_text(json.dumps(STEP) + "\n" + json.dumps(line) + "\n")
    code, out, err = report(str(tmp_path))
    assert code == 2 and out == ""
    assert err.startswith(f"sail report: {tmp_path / 'metrics.jsonl'}:2: {words}"), err
    assert "fix: fix or remove that line" in err
    assert not list(tmp_path.glob("*.png"))


def test_windows_of_different_ranks_are_named(tmp_path: Path) -> None:
    one_rank = {"window": 2, "scores": [1.0], "ms_per_step": {"data": [1.0], "forward": [3.0]}}
    lines = [{**STEP, "stragglers": WINDOW}, {**STEP, "step": 2, "stragglers": one_rank}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, _, err = report(str(tmp_path))
    assert code == 2 and "metrics.jsonl:2: its straggler window has 1 ranks" in err, err


def test_a_line_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_bytes(json.dumps(STEP).encode() + b'\n{"step": 2, "x": "\xff"}\n')
    code, _, err = report(str(tmp_path))
    assert code == 2 and "metrics.jsonl:2: byte 18 of the line is not UTF-8" in err, err


def test_infinite_and_missing_values_are_drawn_around(tmp_path: Path) -> None:
    lines = [{"step": 1, "loss": float("inf")}, {"step": 2, "loss": float("nan"), "lr": None},
             {"step": 3, "stragglers": {**WINDOW, "scores": [float("inf"), 1.0]}}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out, err = report(str(tmp_path))
    assert code == 0, err
    assert "loss          : n/a" in out and "samples/s     : n/a" in out
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["breakdown.png", "stragglers.png"]


def test_out_naming_a_file_is_refused_and_the_file_kept(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps(STEP) + "\n")
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = report(str(tmp_path), "--out", str(tmp_path / "notes.txt"))
    assert code == 2 and f"cannot write the plots to {tmp_path / 'notes.txt'}: it is a file" in err, err
    assert (tmp_path / "notes.txt").read_text() == "mine"
    code, _, err = report(str(tmp_path), "--out", str(tmp_path / "notes.txt" / "plots"))
    assert code == 2 and "cannot write the plots to" in err and "Not a directory" in err, err
