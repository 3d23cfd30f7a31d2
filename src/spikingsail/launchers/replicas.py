"""``sail launch --ft-replicas R``: R replica groups on this machine, each under its own torchrun
agent, and torchft's lighthouse, which ``sail launch`` starts, watches and starts again if it dies.

Every group is the job ``sail launch -n N`` would start (its own rendezvous, its own
``--max-restarts``), with ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE`` set;
the engine reads them and joins torchft's quorum (``spikingsail.engine.replicas``). A group whose
workers die is restarted by its agent and heals from a live group. The job ends when every group
has ended; its status is the first failing group's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from spikingsail.engine.replicas import ENV_GROUP, ENV_GROUPS, ENV_LIGHTHOUSE
from spikingsail.errors import LaunchError
from spikingsail.launchers.command import FORWARDED, LaunchCommand, python_module
from spikingsail.launchers.lifeline import die_with_this_process
from spikingsail.launchers.spec import LaunchRequest

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    groups: int
    heartbeat_timeout_ms: int
    join_timeout_ms: int
    lighthouse_port: int


def plan_replica_groups(request: LaunchRequest, replicas: ReplicaPlan) -> list[LaunchCommand]:
    """The lighthouse first, then one torchrun agent per replica group."""
    if request.nodes:
        raise LaunchError(
            "--ft-replicas with -H",
            "replica groups start on this machine so far; spreading them over a hostfile's nodes is not built yet",
            "run the groups on one machine (drop -H), or launch without --ft-replicas",
        )
    address = f"http://127.0.0.1:{replicas.lighthouse_port}"
    # torchft's Rust parts log every quorum and vote at INFO; warnings and errors stay
    quiet = {} if "RUST_LOG" in os.environ else {"RUST_LOG": "warn"}
    commands = [LaunchCommand(host="localhost", argv=lighthouse_argv(replicas), env=quiet)]
    for group in range(replicas.groups):
        argv = python_module(
            "torch.distributed.run", *request.torchrun_args, request.script, *request.script_args
        )
        env = {ENV_GROUP: str(group), ENV_GROUPS: str(replicas.groups), ENV_LIGHTHOUSE: address, **quiet}
        commands.append(LaunchCommand(host="localhost", argv=argv, env=env))
    return commands


def lighthouse_argv(replicas: ReplicaPlan) -> list[str]:
    program = Path(sys.executable).parent / "torchft_lighthouse"
    return [
        str(program), "--min_replicas", "1", "--quorum_tick_ms", "100",
        "--join_timeout_ms", str(replicas.join_timeout_ms),
        "--heartbeat_timeout_ms", str(replicas.heartbeat_timeout_ms),
        "--bind", f"127.0.0.1:{replicas.lighthouse_port}",
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_replica_groups(commands: list[LaunchCommand]) -> int:
    """Start the lighthouse and the groups; start the lighthouse again whenever it dies while a
    group runs; pass signals on to the groups. Returns the first failing group's status (0: all
    ended well)."""
    lighthouse_command, *groups = commands
    if not Path(lighthouse_command.argv[0]).exists():
        raise LaunchError(
            f"torchft's lighthouse is not installed ({lighthouse_command.argv[0]})",
            "--ft-replicas runs torchft: its lighthouse forms each step's quorum",
            "install the pinned torchft (scripts/setup.sh does), or launch without --ft-replicas",
        )
    lighthouse = _start(lighthouse_command)
    agents = [_start(command) for command in groups]
    received: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                agent.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        while any(agent.poll() is None for agent in agents):
            if lighthouse.poll() is not None and not received:
                log.warning(
                    "torchft's lighthouse ended (status %s): starting it again", lighthouse.returncode
                )
                lighthouse = _start(lighthouse_command)
            time.sleep(POLL_SECONDS)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        lighthouse.terminate()
        try:
            lighthouse.wait(timeout=5)
        except subprocess.TimeoutExpired:
            lighthouse.kill()
            lighthouse.wait()
    if received:
        return 128 + received[0]
    return next((code for code in (agent.returncode for agent in agents) if code), 0)


def _start(command: LaunchCommand) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        command.argv,
        env={**os.environ, **command.env},
        preexec_fn=die_with_this_process(),  # noqa: PLW1509 - started from the main thread
    )
