"""What rank 0 of ``sail bench comm`` makes of the numbers: nccl-tests' table, a JSON file, and a
PNG of bus bandwidth against message size with one line per operation.

The PNG is drawn on matplotlib's Agg canvas directly (no pyplot), so nothing global — pyplot's
backend, its open figures — changes in the process; matplotlib is imported only to draw, and a
machine without it still gets the table and the JSON.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spikingsail.diagnostics.comm_bench import Row

log = logging.getLogger(__name__)

_SUFFIXES = ("", "K", "M", "G", "T")


def _time_text(us: float) -> str:
    """nccl-tests' precision: fewer decimals as the time grows."""
    return f"{us:.0f}" if us >= 10000 else f"{us:.1f}" if us >= 100 else f"{us:.2f}"


def table(op: str, rows: list[Row], meta: dict[str, object]) -> str:
    lines = [
        f"# {op}: {meta['world_size']} ranks, {meta['backend']} on {meta['device']}, "
        f"{meta['iters']} timed after {meta['warmup']} warm-up operations per size; "
        "time is the mean over ranks",
        f"# {'size':>12}  {'count':>12}  {'dtype':>8}  {'time':>9}  {'algbw':>7}  {'busbw':>7}  {'#wrong':>6}",
        f"# {'(B)':>12}  {'(elements)':>12}  {'':>8}  {'(us)':>9}  {'(GB/s)':>7}  {'(GB/s)':>7}  {'':>6}",
    ]
    for r in rows:
        lines.append(
            f"  {r.size_bytes:>12}  {r.count:>12}  {r.dtype:>8}  {_time_text(r.time_us):>9}  "
            f"{r.algbw_gbps:>7.2f}  {r.busbw_gbps:>7.2f}  {r.wrong:>6}"
        )
    lines.append(f"# avg busbw: {average_busbw(rows):.3f} GB/s")
    return "\n".join(lines)


def average_busbw(rows: list[Row]) -> float:
    return sum(r.busbw_gbps for r in rows) / len(rows) if rows else 0.0


def write_report(results: dict[str, list[Row]], meta: dict[str, object], prefix: Path) -> None:
    """``prefix``.json with every number, and ``prefix``.png when matplotlib is installed."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    document = {
        **meta,
        "results": {op: [asdict(r) for r in rows] for op, rows in results.items()},
        "avg_busbw_gbps": {op: average_busbw(rows) for op, rows in results.items()},
    }
    json_path = prefix.with_name(prefix.name + ".json")
    json_path.write_text(json.dumps(document, indent=2) + "\n")
    png_path = prefix.with_name(prefix.name + ".png")
    series = {op: [(r.size_bytes, r.busbw_gbps) for r in rows] for op, rows in results.items()}
    title = f"busbw, {meta['world_size']} ranks, {meta['backend']}, {meta['dtype']}"
    try:
        save_busbw_plot(png_path, series, title)
    except ImportError as err:  # matplotlib is not a requirement of the package
        log.warning("no plot: %s (pip install matplotlib); the numbers are in %s", err, json_path)
        print(f"# wrote {json_path}", flush=True)
        return
    print(f"# wrote {png_path} and {json_path}", flush=True)


def size_label(size: float) -> str:
    """1024 → 1K, 67108864 → 64M: the size in the nccl-tests suffixes (powers of 1024)."""
    step = 0
    while abs(size) >= 1024 and step < len(_SUFFIXES) - 1:
        size /= 1024
        step += 1
    return f"{size:g}{_SUFFIXES[step]}"


def save_busbw_plot(path: Path, series: dict[str, list[tuple[int, float]]], title: str) -> None:
    """``series``: per operation, (size in bytes, busbw in GB/s) points."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator

    figure = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for op, points in series.items():
        axes.plot([s for s, _ in points], [b for _, b in points], marker="o", label=op)
    axes.set_xscale("log", base=2)
    # one tick per power of two is too dense over a wide sweep; LogLocator thins them out
    axes.xaxis.set_major_locator(LogLocator(base=2, numticks=12))
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _pos: size_label(value)))
    axes.set_xlabel("message size (bytes)")
    axes.set_ylabel("busbw (GB/s)")
    axes.set_ylim(bottom=0)
    axes.set_title(title)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png")
