"""``sail launch``: parse, print the plan, run it."""

from __future__ import annotations

import logging

from spikingsail.launchers.command import run_local
from spikingsail.launchers.local import parse_launch

log = logging.getLogger(__name__)


def run(argv: list[str]) -> int:
    launch = parse_launch(argv)
    commands = launch.commands()
    if launch.dry_run:
        for command in commands:
            print(command.render())
        return 0
    (command,) = commands
    log.info("launching %s process(es): %s", launch.nproc_per_node, command.render())
    return run_local(command)
