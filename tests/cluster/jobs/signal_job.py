"""A plain torchrun worker for the launch tests: records what it was given, then waits for a signal.

signal_job.py OUT_DIR [--env NAME]... [--timeout SECONDS]

Every rank writes OUT_DIR/env{RANK}.json (the named variables, None when unset) and then
OUT_DIR/started{RANK} (its pid), and sleeps. On SIGUSR1 it writes OUT_DIR/usr1-{RANK} and exits 75,
as the engine does after its preemption checkpoint; other signals have their default effect. It
ends by itself (status 0) when OUT_DIR/stop appears or after --timeout seconds, so a test that
fails cannot leave it running. No torch: it starts in a blink.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--env", action="append", default=[])
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    rank = os.environ.get("RANK") or os.environ["HOROVOD_RANK"]  # torchrun, or horovodrun
    args.out.mkdir(parents=True, exist_ok=True)

    def on_usr1(_signum: int, _frame: FrameType | None) -> None:
        (args.out / f"usr1-{rank}").touch()
        sys.exit(75)

    signal.signal(signal.SIGUSR1, on_usr1)
    (args.out / f"env{rank}.json").write_text(json.dumps({name: os.environ.get(name) for name in args.env}))
    (args.out / f"started{rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline and not (args.out / "stop").exists():
        time.sleep(0.1)


if __name__ == "__main__":
    main()
