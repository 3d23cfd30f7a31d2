"""One torchrun agent per node, each started over its own ssh connection.

``ssh -tt`` gives the remote agent a terminal: when the connection ends — the job is stopped,
another node failed, the launching machine died — the agent gets SIGHUP and stops its workers,
so nothing is left running on the node. An agent that does not answer the hang-up (one waiting
in torchrun's exit barrier) is killed over a second connection once the grace period is over.
"""

from __future__ import annotations

import shutil

from spikingsail.launchers.agents import (
    Rendezvous,
    agent_argv,
    leftover_cleanup,
    node_env,
    remote_shell_command,
)
from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.remote_env import remote_env
from spikingsail.launchers.request import LaunchRequest


class SSHLauncher:
    name = "ssh"

    @staticmethod
    def exists() -> bool:
        return shutil.which("ssh") is not None

    def commands(self, request: LaunchRequest) -> list[LaunchCommand]:
        assert request.nodes, "parse_request gives multi-node launchers their nodes"
        rdzv = Rendezvous.for_request(request, request.nodes)
        shipped = remote_env(request.env)
        return [
            LaunchCommand(
                host=node.host,
                argv=[
                    "ssh", "-tt", *request.ssh.args(), node.host,
                    remote_shell_command(agent_argv(request, node, rdzv), node_env(node, shipped)),
                ],
                cleanup=["ssh", *request.ssh.args(), node.host, leftover_cleanup(rdzv)],
            )
            for node in request.nodes
        ]  # fmt: skip
