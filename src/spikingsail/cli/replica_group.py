"""One replica group of ``sail launch --ft-replicas R -H hostfile``: the multi-node job of the
group's nodes, run as a child of the top-level ``sail launch``, which restarts it when it fails
while other groups train (``spikingsail.launchers.replicas``). Not a command of its own."""

from __future__ import annotations

import os
import sys

from spikingsail.errors import SailError
from spikingsail.exits import exit_now
from spikingsail.launchers.replicas import ENV_GROUP_REQUEST, decode_request
from spikingsail.launchers.run import run_request
from spikingsail.monitor.logs import configure_logging


def main() -> int:
    configure_logging()
    try:
        request = decode_request(os.environ.pop(ENV_GROUP_REQUEST))
        return run_request(request)
    except SailError as err:
        print(f"sail launch: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    exit_now(main())
