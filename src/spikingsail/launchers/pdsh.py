"""torchrun agents started through pdsh (DeepSpeed's default multi-node transport).

pdsh runs one command line on many hosts, so hosts are grouped by what differs per node (their
slots); ``-S`` makes pdsh return the largest remote exit status instead of 0. pdsh passes no
standard input to the hosts, so each node's environment goes ahead over ssh (as for the ssh
launcher): no value is on a command line.

pdsh returns only when every host is done, but reports each host's failure as it happens. A node
whose rank failed after the others finished would otherwise keep the job waiting in the healthy
agents' exit barrier (torchrun waits 300 s for the failed agent, which never arrives), so the job
is stopped at that report, and agents that outlive their connection are killed afterwards.
"""

from __future__ import annotations

import shlex
import shutil
import uuid
from itertools import groupby

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

# pdsh's own reports of a host's remote command ("%p: %S: %s exited with exit code %d" and
# its siblings), e.g. "pdsh@node1: node2: ssh exited with exit code 1".
NODE_FAILURE = (
    r"^pdsh@[^:\s]+: (?P<host>[^:\s]+): \S+ "
    r"(?:exited with exit code (?P<code>\d+)|killed by signal (?P<signal>\d+)|exited with nonzero status)"
)


class PdshLauncher(Launcher):
    name = "pdsh"
    hosts_replica_groups = True
    install_hint = "apt-get install pdsh"

    @staticmethod
    def exists() -> bool:
        return shutil.which("pdsh") is not None

    def commands(self, request: LaunchRequest) -> list[LaunchCommand]:
        assert request.nodes, "parse_request gives multi-node launchers their nodes"
        rdzv = Rendezvous.for_request(request, request.nodes)
        shipped = remote_env(request.env)
        pdsh_env = {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": shlex.join(["-tt", *request.ssh.args()])}
        commands = []
        for _slots, group in groupby(sorted(request.nodes, key=lambda n: n.slots), key=lambda n: n.slots):
            nodes = list(group)
            hosts = ",".join(n.host for n in nodes)
            env = node_env(nodes[0], shipped)  # the same for the group: it differs only by slots
            env_file = EnvFile(token=uuid.uuid4().hex) if env else None
            remote = agent_shell_command(agent_argv(request, nodes[0], rdzv), env_file)
            commands.append(
                LaunchCommand(
                    host=hosts,
                    argv=["pdsh", "-S", "-f", "1024", "-w", hosts, remote],
                    env=pdsh_env,
                    uploads=[env_upload(n, env, env_file, request.ssh) for n in nodes] if env_file else [],
                    node_failure=NODE_FAILURE,
                    host_prefixed=True,
                    cleanup=["pdsh", "-f", "1024", "-w", hosts, leftover_cleanup(rdzv, env_file)],
                    relay=["pdsh", "-f", "1024", "-w", hosts, signal_relay(rdzv)],
                )
            )
        return [*commands, *(tether(request, node.host, agent_regex(rdzv)) for node in request.nodes)]
