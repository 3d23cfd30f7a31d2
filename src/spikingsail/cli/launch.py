"""``sail launch``: read the command line; ``launchers.run`` plans and runs the job."""

from __future__ import annotations

from spikingsail.launchers.request import parse_request
from spikingsail.launchers.run import launch


def run(argv: list[str]) -> int:
    return launch(parse_request(argv))
