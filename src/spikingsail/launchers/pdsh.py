"""torchrun agents started through pdsh (DeepSpeed's default multi-node transport).

pdsh runs one command line on many hosts, so hosts are grouped by what differs per node (their
slots); ``-S`` makes pdsh return the largest remote exit status instead of 0.
"""

from __future__ import annotations

import shlex
import shutil
from itertools import groupby

from spikingsail.launchers.agents import Rendezvous, agent_argv, node_env, remote_shell_command
from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.remote_env import remote_env
from spikingsail.launchers.request import LaunchRequest


class PdshLauncher:
    name = "pdsh"

    @staticmethod
    def exists() -> bool:
        return shutil.which("pdsh") is not None

    def commands(self, request: LaunchRequest) -> list[LaunchCommand]:
        assert request.nodes, "parse_request gives multi-node launchers their nodes"
        rdzv = Rendezvous.for_request(request, request.nodes)
        shipped = remote_env(request.env)
        ssh_args = ["-tt", *request.ssh.args()]
        commands = []
        for _slots, group in groupby(sorted(request.nodes, key=lambda n: n.slots), key=lambda n: n.slots):
            nodes = list(group)
            remote = remote_shell_command(agent_argv(request, nodes[0], rdzv), node_env(nodes[0], shipped))
            commands.append(
                LaunchCommand(
                    host=",".join(n.host for n in nodes),
                    argv=["pdsh", "-S", "-f", "1024", "-w", ",".join(n.host for n in nodes), remote],
                    env={"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": shlex.join(ssh_args)},
                )
            )
        return commands
