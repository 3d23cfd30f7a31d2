"""Local multi-process launch: torchrun's elastic agent on this machine."""

from __future__ import annotations

from spikingsail.launchers.command import LaunchCommand, python_module
from spikingsail.launchers.request import LaunchRequest


class LocalLauncher:
    name = "local"

    def commands(self, request: LaunchRequest) -> list[LaunchCommand]:
        argv = python_module(
            "torch.distributed.run", *request.torchrun_args, request.script, *request.script_args
        )
        return [LaunchCommand(host="localhost", argv=argv)]
