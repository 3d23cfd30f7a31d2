"""The per-node torchrun agent command that the ssh and pdsh launchers run on every node."""

from __future__ import annotations

import os
import shlex
import sys
import uuid
from dataclasses import dataclass

from spikingsail.launchers.command import LaunchCommand, Upload
from spikingsail.launchers.hostfile import Node
from spikingsail.launchers.lifeline import AGENT_GRACE_SECONDS, LIFELINE
from spikingsail.launchers.remote_env import EnvFile
from spikingsail.launchers.spec import LaunchRequest, SSHOptions


@dataclass(kw_only=True, slots=True, frozen=True)
class Rendezvous:
    endpoint: str
    """host:port of the c10d store, on the first node."""
    run_id: str
    nnodes: int

    @classmethod
    def for_request(cls, request: LaunchRequest, nodes: list[Node]) -> Rendezvous:
        endpoint = request.rdzv_endpoint or f"{nodes[0].host}:{request.master_port}"
        return cls(
            endpoint=endpoint, run_id=request.rdzv_id or f"sail-{uuid.uuid4().hex[:12]}", nnodes=len(nodes)
        )


def agent_argv(request: LaunchRequest, node: Node, rdzv: Rendezvous) -> list[str]:
    """torchrun for one node: same Python, c10d rendezvous on the first node, this node's process count."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(rdzv.nnodes),
        "--nproc-per-node", str(node.nproc),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", rdzv.endpoint,
        "--rdzv-id", rdzv.run_id,
        *request.torchrun_args,
        request.script, *request.script_args,
    ]  # fmt: skip


def leftover_cleanup(rdzv: Rendezvous, env_file: EnvFile | None = None) -> str:
    """A shell line for a node whose connection was cut: the job's torchrun agents get
    ``AGENT_GRACE_SECONDS`` to stop their workers on the hang-up, and once no agent has a worker
    left, a second to end by themselves; then whatever is left of them, agents and workers, is
    killed and named. An environment file the agent never read is removed.

    An agent answers a hang-up only between Python calls. One waiting in torchrun's exit barrier
    for an agent that failed (and so never arrives) sits in a store wait for 300 s, holding the
    rendezvous port, its workers long gone. The agents are found by the job's rendezvous id on
    their command line; a worker by its agent (a zombie one, not reaped yet, has ended).
    """
    pattern = _agent_pattern(rdzv)
    ticks = AGENT_GRACE_SECONDS * 2
    script = (
        f"working() {{ for p in $(pgrep -f -- {pattern}); do for c in $(pgrep -P $p); do "
        "grep -qs '^State:[[:space:]]*[^Z[:space:]]' /proc/$c/status && return 0; done; done; return 1; }; "
        f"i=0; while working && [ $i -lt {ticks} ]; do sleep 0.5; i=$((i+1)); done; "
        f"j=0; while pgrep -f -- {pattern} >/dev/null && [ $j -lt 2 ] && [ $i -lt {ticks} ]; do "
        "sleep 0.5; i=$((i+1)); j=$((j+1)); done; "
        f"for p in $(pgrep -f -- {pattern}); do pkill -KILL -P $p; kill -KILL $p && "
        'echo "killed torchrun agent $p on $(hostname): it did not stop on the hang-up"; '
        "done; true"
    )
    removal = f"{env_file.remove()}; " if env_file else ""
    return f"{removal}sh -c {shlex.quote(script)}"


def signal_relay(rdzv: Rendezvous) -> str:
    """A shell line that passes the signal named by the word after it (``USR1``) to the job's
    torchrun agents on the host it runs on; each agent passes it to its workers.

    Only agents in this host's network namespace: where nodes share a process table (containers,
    the test cluster's namespaces), an agent of another node must not get the signal twice.
    """
    script = f'pkill --signal "$0" --ns $$ --nslist net -f -- {_agent_pattern(rdzv)} || true'
    return f"sh -c {shlex.quote(script)}"


def top_processes_signal(pattern: str) -> str:
    """A shell line that sends the signal named by ``$0`` to the processes matching ``pattern`` (an
    extended regular expression for ``pgrep -f``) in this host's network namespace, except those
    whose parent matches too: a rank's forked children (data loader workers) share its command line,
    and only the rank itself is told, as torchrun's agent tells only its workers."""
    return (
        f'pids=" $(pgrep --ns $$ --nslist net -f -- {pattern} | tr "\\n" " ") "; '
        'for p in $pids; do pp=$(ps -o ppid= -p "$p" | tr -d " "); '
        'case "$pids" in *" $pp "*) ;; *) kill -s "$0" "$p" 2>/dev/null;; esac; done; true'
    )


def _agent_pattern(rdzv: Rendezvous) -> str:
    return shlex.quote(agent_regex(rdzv))


def agent_regex(rdzv: Rendezvous) -> str:
    """The job's torchrun agents, by their whole command line: on the launching machine the ssh
    clients (and pdsh) that started them carry the same words inside their remote command."""
    return rf"^[^ ]+ -m torch[.]distributed[.]run .*--rdzv-id {literal_pattern(rdzv.run_id)}( |$)"


def tether(request: LaunchRequest, host: str, job_regex: str, *, ranks: bool = False) -> LaunchCommand:
    """A second connection to ``host`` that carries a heartbeat from ``sail launch``: should it
    stop for ``--heartbeat-timeout`` seconds (the launching host was lost, or the network to it
    cut) or end without sail saying the job is done, the host ends its part of the job by itself:
    the processes whose command line matches ``job_regex`` (the torchrun agents of ssh and pdsh
    jobs, ``agent_regex``; the ranks of mpirun and horovodrun jobs, ``rank_regex``, with ``ranks``).
    A tether of agents also passes the signals sail forwards on to them (``signal NAME`` lines)."""
    timeout = request.ssh.heartbeat_timeout
    remote = [
        sys.executable,
        "-I",
        LIFELINE,
        "tether",
        job_regex,
        str(timeout),
        "ranks" if ranks else "agents",
    ]
    return LaunchCommand(
        host=host,
        argv=request.ssh.command(host, shlex.join(remote), keepalive=True),
        heartbeat_timeout=timeout,
        passes_signals=not ranks,
    )


RANK_MARK = "sail-run="


def rank_mark(run_id: str) -> list[str]:
    """Python options that mark every rank of a job on its command line: ``-X sail-run=RUN_ID``
    (an option Python keeps in ``sys._xoptions`` and otherwise ignores). Launchers without a
    torchrun agent (mpirun, horovodrun) find the job's ranks on a host by it."""
    return ["-X", RANK_MARK + run_id]


def rank_regex(run_id: str) -> str:
    """The ranks marked by ``rank_mark(run_id)`` (and their forked children, which share the line)."""
    return rf"^[^ ]+ -X {literal_pattern(RANK_MARK + run_id)}( |$)"


def literal_pattern(text: str) -> str:
    """An extended regular expression that matches ``text`` but not its own spelling, so that
    pgrep does not find the shell that runs it: every character in brackets of its own, where
    nothing is special but a leading ``^``."""
    return "".join("\\^" if c == "^" else f"[{c}]" for c in text)


def node_env(node: Node, shipped: dict[str, str]) -> dict[str, str]:
    env = dict(shipped)
    if node.slots != tuple(range(node.nproc)):
        # --include host:1,3 — the node's processes see only those GPUs, as local ranks 0 and 1.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, node.slots))
    return env


def remote_shell_command(argv: list[str], env: dict[str, str], workdir: str | None = None) -> str:
    """One shell line: same working directory, explicit environment, then exec the agent.

    The values are on the line: for variables that may be credentials use ``agent_shell_command``.
    """
    workdir = workdir or os.getcwd()
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return f"cd {shlex.quote(workdir)} && exec env {assignments} {shlex.join(argv)}".replace("env  ", "env ")


def agent_shell_command(argv: list[str], env_file: EnvFile | None, workdir: str | None = None) -> str:
    """One shell line: the uploaded environment read (and its file removed), the same working
    directory, then exec the agent; no value of a variable is on it."""
    start = f"cd {shlex.quote(workdir or os.getcwd())} && exec {shlex.join(argv)}"
    return f"{env_file.source()} && {start}" if env_file else start


def env_upload(node: Node, env: dict[str, str], env_file: EnvFile, ssh: SSHOptions) -> Upload:
    return Upload(host=node.host, argv=ssh.command(node.host, env_file.receive()), env=env)
