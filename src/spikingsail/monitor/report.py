"""``sail report``: a run's metrics file (``sail.metrics_path``) as PNG plots and a short summary.

Plots (drawn on matplotlib's Agg canvas, no pyplot): ``loss.png``, ``lr.png``, ``throughput.png``
(samples/s), and with straggler windows in the file ``breakdown.png`` (each rank's milliseconds per
step in every phase over time) and ``stragglers.png`` (each rank's score over time).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spikingsail.errors import SailError


class ReportError(SailError):
    """A metrics file that cannot be read or drawn."""


@dataclass(slots=True)
class Run:
    path: Path
    steps: list[dict[str, Any]] = field(default_factory=list)

    @property
    def windows(self) -> list[dict[str, Any]]:
        return [{"step": s["step"], **s["stragglers"]} for s in self.steps if "stragglers" in s]

    @property
    def changes(self) -> list[dict[str, Any]]:
        return [{"step": s["step"], **s["balance"]} for s in self.steps if "balance" in s]


def metrics_file(path: Path) -> Path:
    """``path`` itself, or the one ``*.jsonl`` file in the directory ``path``."""
    if path.is_file():
        return path
    if path.is_dir():
        found = sorted(path.glob("*.jsonl"))
        if len(found) == 1:
            return found[0]
        raise ReportError(
            f"{path}: {'no' if not found else len(found)} metrics files (*.jsonl) in the directory",
            "sail report draws one run's metrics file (the engine writes it where sail.metrics_path says)",
            "name the file: sail report RUN_DIR/metrics.jsonl",
        )
    raise ReportError(
        f"{path} does not exist", fix="give the run's metrics file (sail.metrics_path) or its directory"
    )


def read_run(path: Path) -> Run:
    run = Run(path)
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ReportError(
                f"{path}:{number}: not a JSON line ({err.msg})",
                "each line of a metrics file is one optimizer step's JSON object",
                "a run killed mid-write leaves a partial last line: remove it",
            ) from None
        if not isinstance(record, dict) or "step" not in record:
            raise ReportError(
                f"{path}:{number}: a JSON line without a 'step'",
                "this is not a SpikingSail metrics file (sail.metrics_path)",
            )
        if "log" not in record:  # engine.log's lines hold the script's own metrics
            run.steps.append(record)
    if not run.steps:
        raise ReportError(
            f"{path}: no steps", "the metrics file is empty", "train at least one optimizer step"
        )
    return run


def summary(run: Run) -> str:
    steps = run.steps
    losses = [
        s["loss"] for s in steps if isinstance(s.get("loss"), (int, float)) and math.isfinite(s["loss"])
    ]
    tail = steps[-max(1, len(steps) // 10) :]
    rows = [
        ("steps", f"{steps[0]['step']} to {steps[-1]['step']} ({len(steps)} recorded)"),
        ("samples", str(steps[-1].get("samples", "n/a"))),
        (
            "loss",
            f"first {losses[0]:.4g}, last {losses[-1]:.4g}, lowest {min(losses):.4g}" if losses else "n/a",
        ),
        (
            "samples/s",
            f"{statistics.median(s['samples_per_sec'] for s in tail):.1f} (median of the last {len(tail)} steps)",
        ),
        ("skipped steps", str(sum(1 for s in steps if s.get("skipped")))),
    ]
    if run.changes:
        last = run.changes[-1]
        rows.append(
            ("balance", f"{len(run.changes)} change(s), last at step {last['step']}: split {last['split']}")
        )
    if run.windows:
        worst = max(run.windows, key=lambda w: max(w["scores"]))
        rank = max(range(len(worst["scores"])), key=worst["scores"].__getitem__)
        rows.append(("slowest rank", f"rank {rank}, ×{worst['scores'][rank]:.2f} the others at step {worst['step']} "
                                     f"({len(run.windows)} straggler windows)"))  # fmt: skip
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}} : {value}" for name, value in rows)


class _Canvas:
    """Figures on matplotlib's Agg canvas, saved as ``out/NAME.png``."""

    def __init__(self, out: Path) -> None:
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as err:
            raise ReportError(
                f"cannot draw: {err}", "sail report draws with matplotlib", 'pip install "spikingsail[plot]"'
            ) from None
        self._figure, self._canvas = Figure, FigureCanvasAgg
        self.out = out
        self.written: list[Path] = []

    def axes(self, columns: int = 1) -> tuple[Any, list[Any]]:
        fig = self._figure(figsize=(4 * columns + 4, 4), dpi=100)
        self._canvas(fig)
        return fig, list(fig.subplots(1, columns, squeeze=False)[0])

    def save(self, fig: Any, name: str) -> None:
        fig.tight_layout()
        path = self.out / f"{name}.png"
        fig.savefig(path, format="png")
        self.written.append(path)


def draw(run: Run, out: Path) -> list[Path]:
    """The PNGs of ``run`` in ``out``; returns their paths."""
    canvas = _Canvas(out)
    out.mkdir(parents=True, exist_ok=True)
    _draw_series(run, canvas)
    if run.windows:
        _draw_windows(run, canvas)
    return canvas.written


def _draw_series(run: Run, canvas: _Canvas) -> None:
    x = [s["step"] for s in run.steps]
    for key, name, label in (("loss", "loss", "loss"), ("lr", "lr", "learning rate"),
                             ("samples_per_sec", "throughput", "samples/s")):  # fmt: skip
        points = [
            (s, v[key]) for s, v in zip(x, run.steps, strict=True) if isinstance(v.get(key), (int, float))
        ]
        if not points:
            continue
        fig, (ax,) = canvas.axes()
        ax.plot([p for p, _ in points], [v for _, v in points])
        for change in run.changes if name == "throughput" else []:
            ax.axvline(change["step"], color="grey", alpha=0.4)  # a new balance split
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        ax.set_title(f"{label} — {run.path.name}")
        ax.grid(True, alpha=0.3)
        canvas.save(fig, name)


def _draw_windows(run: Run, canvas: _Canvas) -> None:
    windows = run.windows
    ranks = range(len(windows[0]["scores"]))
    steps = [w["step"] for w in windows]
    phases = list(windows[0]["ms_per_step"])  # as the engine named them, in its order
    fig, axes = canvas.axes(len(phases))
    for ax, phase in zip(axes, phases, strict=True):
        for rank in ranks:
            ax.plot(steps, [w["ms_per_step"][phase][rank] for w in windows], label=f"rank {rank}")
        ax.set_title(phase)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("ms per step")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    canvas.save(fig, "breakdown")
    fig, (ax,) = canvas.axes()
    for rank in ranks:
        ax.plot(steps, [w["scores"][rank] for w in windows], marker="o", label=f"rank {rank}")
    ax.axhline(1.0, color="grey", alpha=0.4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("work ÷ the other ranks' median")
    ax.set_title("straggler scores")
    ax.grid(True, alpha=0.3)
    ax.legend()
    canvas.save(fig, "stragglers")
