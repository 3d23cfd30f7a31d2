"""``python -m tests.matrix --all`` (every cell), ``--sample N [--seed S]``, ``--cell ID``, ``--list``."""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback

from tests.matrix.cells import Cell, all_cells, sample
from tests.matrix.runner import check, run_cell
from tests.ninja import EXTENSIONS_DIR


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.matrix", description=__doc__)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--all", action="store_true", help="every cell")
    which.add_argument("--sample", type=int, metavar="N", help="N cells drawn with --seed")
    which.add_argument("--cell", action="append", metavar="ID", help="this cell (repeatable)")
    which.add_argument("--list", action="store_true", help="print the cells and what each guarantees")
    parser.add_argument("--seed", type=int, default=random.SystemRandom().randrange(10**6))
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)
    if args.list:
        for cell in all_cells():
            print(f"{cell.id:45} {('refuses: ' + cell.refusal) if cell.refusal else cell.tolerance.why}")
        return 0
    cells = (
        all_cells()
        if args.all
        else [Cell.parse(c) for c in args.cell]
        if args.cell
        else sample(args.seed, args.sample)
    )
    if args.sample:
        print(
            f"matrix sample: seed {args.seed}, {len(cells)} cells (replay: --sample {args.sample} --seed {args.seed})"
        )
    failed = 0
    for cell in cells:
        start = time.monotonic()
        try:
            check(cell, run_cell(cell))
            verdict = "ok"
        except Exception:  # report every cell, then fail
            failed += 1
            verdict = "FAILED\n" + traceback.format_exc(limit=3)
        print(f"{cell.id:45} {time.monotonic() - start:6.1f}s  {verdict}", flush=True)
    print(f"{len(cells) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
