"""``sail report``: a run's metrics file (``sail.metrics_path``) as PNG plots and a short summary.

Plots (drawn on matplotlib's Agg canvas, no pyplot): ``loss.png``, ``lr.png``, ``throughput.png``
(samples/s), and with straggler windows in the file ``breakdown.png`` (each rank's milliseconds per
step in every phase over time) and ``stragglers.png`` (each rank's score over time).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spikingsail.errors import SailError, first_line


class ReportError(SailError):
    """A metrics file that cannot be read or drawn."""


@dataclass(slots=True)
class Run:
    path: Path
    steps: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    """What happened to the run besides its steps (``{"step": N, "event": "checkpoint_failed", ...}``)."""

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
    """The steps of a metrics file, every line checked here (``_line_problem``), so that the summary
    and the plots can use what this returns as it is. Lines of the script's own metrics
    (``engine.log``) and of events (a failed save) are not steps: they are left out."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ReportError(
            f"cannot read {path}", first_line(err), "check the path and its permissions"
        ) from None
    run = Run(path)
    shape: tuple[int, tuple[str, ...]] | None = None  # the first straggler window's ranks and phases
    for number, raw in enumerate(data.split(b"\n"), 1):
        record = _decode(path, number, raw)
        if record is not None and "event" in record:
            run.events.append(record)
        if record is None or "log" in record or "event" in record:
            continue
        problem = _step_problem(record)
        if problem is None and "stragglers" in record:
            window = record["stragglers"]
            shape = shape or (len(window["scores"]), tuple(window["ms_per_step"]))
            if (len(window["scores"]), tuple(window["ms_per_step"])) != shape:
                problem = (f"its straggler window has {len(window['scores'])} ranks and phases "
                           f"{list(window['ms_per_step'])}; the first had {shape[0]} and {list(shape[1])}")  # fmt: skip
        if problem:
            raise ReportError(f"{path}:{number}: {problem}", _NOT_OURS,
                              "fix or remove that line (sail report reads what the engine writes)")  # fmt: skip
        run.steps.append(record)
    if not run.steps:
        raise ReportError(
            f"{path}: no steps", "the metrics file is empty", "train at least one optimizer step"
        )
    return run


_NOT_OURS = "this line is not one the engine writes to a metrics file (sail.metrics_path)"
_LIMIT = 2**63  # steps and sample counts are int64 in the engine
_NUMBERS = ("loss", "lr", "samples_per_sec", "loss_scale", "time")


def _decode(path: Path, number: int, raw: bytes) -> dict[str, Any] | None:
    """One line as a JSON object (None for a blank line), or ``ReportError`` naming the line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ReportError(f"{path}:{number}: byte {err.start} of the line is not UTF-8",
                          "the engine writes its metrics file as UTF-8 JSON lines",
                          "the file is damaged or not a metrics file: remove the line") from None  # fmt: skip
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ReportError(
            f"{path}:{number}: not a JSON line ({err.msg})",
            "each line of a metrics file is one optimizer step's JSON object",
            "a run killed mid-write leaves a partial last line: remove it",
        ) from None
    except (ValueError, RecursionError) as err:  # an integer of too many digits, too deep a nesting
        raise ReportError(f"{path}:{number}: not a JSON line ({first_line(err)})", _NOT_OURS,
                          "remove the line") from None  # fmt: skip
    if not isinstance(record, dict) or "step" not in record:
        raise ReportError(
            f"{path}:{number}: a JSON line without a 'step'",
            "this is not a SpikingSail metrics file (sail.metrics_path)",
        )
    if not _is_count(record["step"]):
        raise ReportError(f"{path}:{number}: 'step' is {_short(record['step'])}, not a step number",
                          _NOT_OURS, "fix or remove that line")  # fmt: skip
    return record


def _step_problem(record: dict[str, Any]) -> str | None:
    """What in a step's line the summary and plots cannot use (None: nothing)."""
    for key in _NUMBERS:
        if key in record and not (record[key] is None or _is_number(record[key])):
            return f"{key!r} is {_short(record[key])}, not a number"
    if "samples" in record and not _is_count(record["samples"]):
        return f"'samples' is {_short(record['samples'])}, not a count"
    if "skipped" in record and not isinstance(record["skipped"], bool):
        return f"'skipped' is {_short(record['skipped'])}, not true or false"
    if "balance" in record and not (isinstance(record["balance"], dict) and "split" in record["balance"]):
        return f"'balance' is {_short(record['balance'])}, not an object with a 'split'"
    if "stragglers" in record:
        return _window_problem(record["stragglers"])
    return None


def _window_problem(window: Any) -> str | None:
    scores = window.get("scores") if isinstance(window, dict) else None
    if not isinstance(scores, list) or not scores or not all(_is_number(s) for s in scores):
        return f"'stragglers' is {_short(window)}, without a score (a number) for each rank"
    phases = window.get("ms_per_step")
    if not isinstance(phases, dict) or not phases:
        return "'stragglers' has no 'ms_per_step' object of the phases' times"
    for phase, times in phases.items():
        if not isinstance(times, list) or len(times) != len(scores) or not all(_is_number(t) for t in times):
            return f"'stragglers.ms_per_step.{phase}' is {_short(times)}, not one number per rank ({len(scores)})"
    return None


def _is_number(value: Any) -> bool:
    """A JSON number a plot can take: NaN and infinities are (the engine writes a NaN loss), and
    integers beyond what a float holds are not."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return not isinstance(value, int) or abs(value) < _LIMIT


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _LIMIT


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def summary(run: Run) -> str:
    steps = run.steps
    losses = [
        s["loss"] for s in steps if isinstance(s.get("loss"), (int, float)) and math.isfinite(s["loss"])
    ]
    tail = steps[-max(1, len(steps) // 10) :]
    speeds = [s["samples_per_sec"] for s in tail if _is_number(s.get("samples_per_sec"))]
    rows = [
        ("steps", f"{steps[0]['step']} to {steps[-1]['step']} ({len(steps)} recorded)"),
        ("samples", str(steps[-1].get("samples", "n/a"))),
        (
            "loss",
            f"first {losses[0]:.4g}, last {losses[-1]:.4g}, lowest {min(losses):.4g}" if losses else "n/a",
        ),
        (
            "samples/s",
            f"{statistics.median(speeds):.1f} (median of the last {len(tail)} steps)" if speeds else "n/a",
        ),
        ("skipped steps", str(sum(1 for s in steps if s.get("skipped")))),
    ]
    if run.events:
        kinds = Counter(str(e["event"]) for e in run.events)
        told = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
        rows.append(("events", f"{told} (the last at step {run.events[-1]['step']})"))
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
    """The PNGs of ``run`` in ``out`` (a directory, made if missing); returns their paths."""
    if out.exists() and not out.is_dir():
        raise ReportError(f"cannot write the plots to {out}: it is a file", "the plots are files in a directory",
                          "give --out a directory (it is made if missing)")  # fmt: skip
    canvas = _Canvas(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        _draw_series(run, canvas)
        if run.windows:
            _draw_windows(run, canvas)
    except OSError as err:
        raise ReportError(f"cannot write the plots to {out}", first_line(err),
                          "give --out a directory you can write to, on a disk with room") from None  # fmt: skip
    return canvas.written


def _draw_series(run: Run, canvas: _Canvas) -> None:
    x = [s["step"] for s in run.steps]
    for key, name, label in (("loss", "loss", "loss"), ("lr", "lr", "learning rate"),
                             ("samples_per_sec", "throughput", "samples/s")):  # fmt: skip
        points = [(s, v[key]) for s, v in zip(x, run.steps, strict=True)
                  if _is_number(v.get(key)) and math.isfinite(v[key])]  # fmt: skip
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
            ax.plot(steps, [_gap(w["ms_per_step"][phase][rank]) for w in windows], label=f"rank {rank}")
        ax.set_title(phase)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("ms per step")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    canvas.save(fig, "breakdown")
    fig, (ax,) = canvas.axes()
    for rank in ranks:
        ax.plot(steps, [_gap(w["scores"][rank]) for w in windows], marker="o", label=f"rank {rank}")
    ax.axhline(1.0, color="grey", alpha=0.4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("work ÷ the other ranks' median")
    ax.set_title("straggler scores")
    ax.grid(True, alpha=0.3)
    ax.legend()
    canvas.save(fig, "stragglers")


def _gap(value: float) -> float:
    """A value to plot: NaN (a gap in the line) for an infinity, which would break the axis limits."""
    return float(value) if math.isfinite(value) else math.nan
