"""Straggler scores on ranks made unequal for real: rank 1 in a cgroup with a 40% CPU quota.

The throttled run must name rank 1 and its host within three windows of the throttle, in the log
and the metrics file. A balanced run of the same job must not warn over a long run, also when its
ranks are slowed in turns for less than the persistence: episodes of load such as a shared 2-core
machine gives (measured: 1.4–1.8× on one rank for up to three windows, then on the other), which a
fixed ratio over three windows took for a straggler.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import spikingsail
from tests.multiprocess import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.alone, pytest.mark.speed]
WINDOW = 20
MICRO = 128


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


EPISODES = ((0, 71, 110), (1, 191, 230), (0, 311, 350))
"""(rank, first step, last step): 40 steps, 10 of them in each of the windows around a whole one;
from the fourth window on (a run that begins with a rank slowed for three windows is a straggler as
far as its first windows can tell)."""
SLOWER = 0.8
"""An episode adds this much of the rank's own recent step time, in a sleep before the forward."""


def job(
    group: str | None, steps: int, metrics: str, episodes: tuple[tuple[int, int, int], ...] = ()
) -> dict[str, Any]:
    torch.set_num_threads(1)
    if group and os.environ["RANK"] == "1":
        (Path(group) / "cgroup.procs").write_text(str(os.getpid()))
    warnings = Collect()
    logging.getLogger("spikingsail.engine.stragglers").addHandler(warnings)
    torch.manual_seed(0)
    net = torch.nn.Sequential(  # tens of milliseconds of compute a step: well above the quota's period
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )  # fmt: skip
    engine, _ = spikingsail.initialize(
        model=net,
        config={"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
                "sail": {"progress_bar": False, "straggler_window": WINDOW, "metrics_path": metrics}},
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    n = MICRO * 2 * steps
    data = TensorDataset(torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g))
    rank, recent = int(os.environ["RANK"]), 0.0
    for step, (x, y) in enumerate(engine.dataloader(data), 1):
        start = time.perf_counter()
        if any(r == rank and first <= step <= last for r, first, last in episodes):
            time.sleep(SLOWER * recent)  # the data phase: this rank's own work
        else:
            start = time.perf_counter()
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
        if not any(r == rank and first <= step <= last for r, first, last in episodes):
            took = time.perf_counter() - start
            recent = took if not recent else 0.8 * recent + 0.2 * took
    engine.close()
    return {"warnings": warnings.messages, "host": socket.gethostname()}


def windows(metrics: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [{"step": line["step"], **line["stragglers"]} for line in lines if "stragglers" in line]


def test_a_throttled_rank_is_named_with_its_host(slow_group: Path, tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    result = run_ranks(job, 2, str(slow_group), 4 * WINDOW, str(metrics))[0]
    (warning,) = result["warnings"]  # once, not every window
    assert warning.startswith(f"straggler: rank 1 on {result['host']} has taken "), warning
    assert f"to step {3 * WINDOW};" in warning, "three windows of the throttle suffice"
    assert "sail.balance" in warning
    found = windows(metrics)
    assert [w["step"] for w in found] == [WINDOW * i for i in range(1, 5)]
    for window in found:
        slow, fast = window["scores"][1], window["scores"][0]
        assert slow > 1.5 * fast, window  # 40% of a core against a whole one
        assert set(window["ms_per_step"]) == {"data", "forward", "backward", "comm", "optimizer"}
        # the fast rank's wait for the slow one is communication, not work
        assert window["ms_per_step"]["comm"][0] > window["ms_per_step"]["comm"][1], window
    # `sail report` draws the run: PNGs that decode, and a summary naming the slowest rank
    report = subprocess.run([sys.executable, "-m", "spikingsail.cli.main", "report", str(metrics)],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert report.returncode == 0, report.stderr
    assert re.search(r"slowest rank +: rank 1, ×", report.stdout), report.stdout
    for name in ("loss", "lr", "throughput", "breakdown", "stragglers"):
        image = matplotlib.image.imread(tmp_path / f"{name}.png")
        assert image.ndim == 3 and image.shape[0] > 100 and image.std() > 0, name


def test_a_balanced_run_raises_no_alarm(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    result = run_ranks(job, 2, None, 20 * WINDOW, str(metrics))[0]
    assert result["warnings"] == []
    assert len(windows(metrics)) == 20


def test_ranks_slowed_in_turns_for_less_than_three_windows_raise_no_alarm(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    result = run_ranks(job, 2, None, 20 * WINDOW, str(metrics), EPISODES)[0]
    found = windows(metrics)

    def after(last: int) -> int:
        """The index of the window after the last one an episode touched."""
        return (last - 1) // WINDOW + 1

    # The machine is shared: load of its own may keep a rank slow for the window after an episode
    # (seen once in eight suite runs: forward and backward 1.5x on the slowed rank, right after its
    # episode). Then it was slow for three windows after its onset, and a warning is right. Every
    # other episode must pass without one, and a warning may name only such an extended episode.
    extended = {(r, last) for r, _, last in EPISODES if found[after(last)]["scores"][r] >= 1.25}
    for message in result["warnings"]:
        assert any(message.startswith(f"straggler: rank {r} ") and f"(to step {(after(last) + 1) * WINDOW};" in message
                   for r, last in extended), (message, found)  # fmt: skip
    assert len(result["warnings"]) <= len(extended), result["warnings"]
    # an episode that ended with its own windows put its rank at or above the factor in the three
    # windows it touched, the other rank below (what a fixed ratio over three windows warned of)
    touched = [(rank, found[first // WINDOW : first // WINDOW + 3]) for rank, first, last in EPISODES
               if (rank, last) not in extended]  # fmt: skip
    assert any(all(w["scores"][r] >= 1.25 > w["scores"][1 - r] for w in ws) for r, ws in touched), (
        touched,
        found,
    )
