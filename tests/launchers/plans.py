"""The commands that start a job, without the heartbeat connections (``agents.tether``), which
tests/launchers/test_tether.py covers on their own."""

from __future__ import annotations

from spikingsail.launchers import plan as full_plan
from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.request import LaunchRequest


def plan(request: LaunchRequest) -> list[LaunchCommand]:
    return [command for command in full_plan(request) if not command.heartbeat]
