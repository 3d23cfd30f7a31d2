"""One torchrun agent per node, each started over its own ssh connection.

``ssh -tt`` gives the remote agent a terminal: when the connection ends — the job is stopped,
another node failed, the launching machine died — the agent gets SIGHUP and stops its workers,
so nothing is left running on the node. An agent that does not answer the hang-up (one waiting
in torchrun's exit barrier) is killed over a second connection once the grace period is over.

The node's environment goes ahead over a connection of its own, on ssh's standard input (the
agent's connection has a terminal, which would echo it): no value is on a command line.
"""

from __future__ import annotations

import shutil
import uuid

from spikingsail.launchers.agents import (
    Rendezvous,
    agent_argv,
    agent_regex,
    agent_shell_command,
    env_upload,
    leftover_cleanup,
    node_env,
    signal_relay,
    tether,
)
from spikingsail.launchers.base import Launcher
from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.remote_env import EnvFile, remote_env
from spikingsail.launchers.spec import LaunchRequest


class SSHLauncher(Launcher):
    name = "ssh"
    hosts_replica_groups = True
    install_hint = "apt-get install openssh-client"

    @staticmethod
    def exists() -> bool:
        return shutil.which("ssh") is not None

    def commands(self, request: LaunchRequest) -> list[LaunchCommand]:
        assert request.nodes, "parse_request gives multi-node launchers their nodes"
        rdzv = Rendezvous.for_request(request, request.nodes)
        shipped = remote_env(request.env)
        commands = []
        for node in request.nodes:
            env = node_env(node, shipped)
            env_file = EnvFile(token=uuid.uuid4().hex) if env else None
            remote = agent_shell_command(agent_argv(request, node, rdzv), env_file)
            commands.append(
                LaunchCommand(
                    host=node.host,
                    argv=request.ssh.command(node.host, remote, tty=True),
                    uploads=[env_upload(node, env, env_file, request.ssh)] if env_file else [],
                    cleanup=request.ssh.command(node.host, leftover_cleanup(rdzv, env_file)),
                    relay=request.ssh.command(node.host, signal_relay(rdzv)),
                )
            )
        return [*commands, *(tether(request, node.host, agent_regex(rdzv)) for node in request.nodes)]
