"""``sail report``: a run's metrics file as PNG plots and a short summary; with ``--ledger``, the check
of its sample ledger (and ``--against`` another run's)."""

from __future__ import annotations

import argparse
from pathlib import Path

from spikingsail.monitor.report import draw, metrics_file, read_run, summary


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sail report",
        description="Draw a run's metrics file (sail.metrics_path): loss, learning rate, samples/s and, "
        "with several ranks, each rank's step-time breakdown and straggler score over time.",
    )
    p.add_argument("run", type=Path, help="the metrics file (JSON lines), or the directory that holds it")
    p.add_argument("--out", type=Path, help="where the PNGs go (default: beside the metrics file)")
    p.add_argument("--ledger", action="store_true",
                   help="check RUN's sample ledger (sail.ledger) instead: every sample of each finished "
                   "epoch trained once, none twice, the steps in order; exit status 1 when not")  # fmt: skip
    p.add_argument("--against", type=Path, metavar="OTHER_RUN",
                   help="with --ledger: compare with another run's ledger, step by step")  # fmt: skip
    return p


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.ledger or args.against:
        return _ledger(args.run, args.against)
    path = metrics_file(args.run)
    metrics = read_run(path)
    print(_shown(f"{path}:\n{summary(metrics)}"))
    for png in draw(metrics, args.out or path.parent):
        print(_shown(f"wrote {png}"))
    return 0


def _ledger(run: Path, against: Path | None) -> int:
    from spikingsail.monitor import ledger_check

    ours = ledger_check.resolve(run)
    print(_shown(ledger_check.report(ours)))
    failed = bool(ours.problems)
    if against is not None:
        theirs = ledger_check.resolve(against)
        lines, differ = ledger_check.compare(ours, theirs)
        print(_shown("\n".join([f"against {against}:", *lines])))
        failed = failed or differ
    return 1 if failed else 0


def _shown(text: str) -> str:
    """``text`` printable on any terminal: a lone surrogate (a file name's bytes that are not UTF-8,
    a ``\\udcff`` in the file's JSON) as an escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
