"""Run a job's commands side by side and stop all of them as soon as one fails.

Each command's output is relayed line by line with its host as prefix, and the last lines are
kept so that a failure can be reported with the host, the rank torchrun names, the exit status
and what the failing node printed last. SIGINT / SIGTERM stop every command.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from spikingsail.launchers.agents import AGENT_GRACE_SECONDS
from spikingsail.launchers.command import LaunchCommand

TAIL_LINES = 80
TIMED_OUT = 124
_GRACE_SECONDS = 15.0
# A cleanup waits out the agents' own grace period, plus time to connect.
_CLEANUP_SECONDS = AGENT_GRACE_SECONDS + 45.0
# torchrun's failure summary, possibly behind pdsh's "node2: " prefixes:
#   time      : 2026-11-22_03:03:39
#   host      : node2
#   rank      : 1 (local_rank: 0)
#   exitcode  : -9 (pid: 7)  (SIGKILL)
_ROOT_CAUSE = re.compile(
    r"time\s*:\s*(?P<time>\S+)\s*\n[^\n]*?host\s*:\s*(?P<host>\S+)\s*\n"
    r"[^\n]*?rank\s*:\s*(?P<rank>\d+) \(local_rank: (?P<local>\d+)\)\s*\n"
    r"[^\n]*?exitcode\s*:\s*(?P<code>-?\d+)[^\n]*?(?P<signal>\(SIG\w+\))?[ \t]*$",
    re.M,
)


@dataclass(slots=True)
class Running:
    command: LaunchCommand
    process: subprocess.Popen[bytes]
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    failed_node: tuple[str, int] | None = None
    """(host, exit status) of a node the command reported failed while it runs on."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Failure:
    host: str
    exit_code: int
    tail: list[str]

    def describe(self) -> str:
        mpi = _MPI_SIGNAL.search("\n".join(self.tail)) or _MPI_EXIT.search("\n".join(self.tail))
        if mpi is not None:
            where = f"node {mpi['host']}, " if "host" in mpi.groupdict() else ""
            detail = f"{where}rank {mpi['rank']} exited with {mpi['what']}"
            shown = "\n".join(f"    {line}" for line in self.tail[-12:])
            return f"mpirun failed (exit status {self.exit_code}): {detail}; its last output:\n{shown}"
        horovod = _HOROVOD_EXIT.search("\n".join(self.tail))
        if horovod is not None:
            rank = horovod["rank"]
            own = [line.split(":", 1)[1] for line in self.tail if line.startswith(f"[{rank}]<std")]
            shown = "\n".join(f"    {line}" for line in (own or self.tail)[-12:])
            return (f"horovodrun failed (exit status {self.exit_code}): rank {rank} exited with "
                    f"{horovod['code']} first; its last output:\n{shown}")  # fmt: skip
        # Under pdsh one stream carries every node's summary; the earliest failure is the cause,
        # the others are ranks that lost their peers.
        causes = sorted(_ROOT_CAUSE.finditer("\n".join(self.tail)), key=lambda m: m["time"])
        cause = causes[0] if causes else None
        host, detail = self.host, ""
        if cause:
            host = cause["host"]
            detail = f", rank {cause['rank']} (local rank {cause['local']}) exited with {cause['code']}"
            detail += f" {cause['signal']}" if cause["signal"] else ""
        shown = "\n".join(f"    {line}" for line in self.tail[-12:])
        return f"node {host} failed (agent exit status {self.exit_code}){detail}; its last output:\n{shown}"


# mpirun's reports of the first failed rank.
_MPI_SIGNAL = re.compile(
    r"process rank (?P<rank>\d+) with PID \d+ on node (?P<host>\S+) exited on (?P<what>signal \d+[^\n]*)"
)
# horovodrun's (Gloo mode) report of the first failed rank; ranks' lines come as "[R]<stderr>:...".
_HOROVOD_EXIT = re.compile(
    r"The first process to do so was:\s*\nProcess name: (?P<rank>\d+)\s*\nExit code: (?P<code>-?\d+)"
)
_MPI_EXIT = re.compile(r"Process name:\s*\[\[\d+,\d+\],(?P<rank>\d+)\]\s*\n\s*Exit code:\s*(?P<what>-?\d+)")


def print_line(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def supervise(
    commands: list[LaunchCommand],
    *,
    output: Callable[[str], None] = print_line,
    timeout: float | None = None,
) -> tuple[int, Failure | None]:
    """Run all commands; returns (exit status, the first failure or None).

    Every output line goes to ``output``, prefixed with its host. After ``timeout`` seconds every
    command is stopped and the job fails with exit status 124, as timeout(1) does.
    """
    running = [_start(c) for c in commands]
    relays = [threading.Thread(target=_relay, args=(r, output), daemon=True) for r in running]
    for relay in relays:
        relay.start()
    stop: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        failure = _wait(running, stop, None if timeout is None else time.monotonic() + timeout)
    finally:
        stopped = _stop_all(running)
        for relay in relays:
            relay.join(timeout=5)
        _clean_up(stopped, output)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if stop:
        return 128 + stop[0], None
    if failure is not None:
        return failure.exit_code or 1, failure
    return 0, None


def _start(command: LaunchCommand) -> Running:
    process = subprocess.Popen(
        command.argv,
        env={**os.environ, **command.env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # signals reach the children only through this supervisor
    )
    return Running(command=command, process=process)


def _relay(run: Running, output: Callable[[str], None]) -> None:
    assert run.process.stdout is not None
    prefix = f"[{run.command.host}] "
    node_failure = re.compile(run.command.node_failure) if run.command.node_failure else None
    for raw in iter(run.process.stdout.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n").replace("\r", "")
        run.tail.append(line)
        output(prefix + line)
        if node_failure is not None and run.failed_node is None and (found := node_failure.search(line)):
            run.failed_node = (found["host"], _exit_status(found.groupdict()))


def _exit_status(reported: dict[str, str | None]) -> int:
    """A shell's exit status for a reported exit code or signal (any other failure: 1)."""
    if reported.get("code"):
        return int(reported["code"] or 1)
    if reported.get("signal"):
        return 128 + int(reported["signal"] or 0)
    return 1


def _wait(running: list[Running], stop: list[int], deadline: float | None) -> Failure | None:
    while not stop:
        states = [(r, r.process.poll()) for r in running]
        for run, code in states:
            if code not in (None, 0):
                time.sleep(0.3)  # let the relay catch the last lines
                return Failure(host=run.command.host, exit_code=code, tail=list(run.tail))
            if run.failed_node is not None:
                host, node_code = run.failed_node
                time.sleep(0.3)
                return Failure(host=host, exit_code=node_code, tail=list(run.tail))
        if all(code == 0 for _, code in states):
            return None
        if deadline is not None and time.monotonic() > deadline:
            late = next(run for run, code in states if code is None)
            return Failure(host=late.command.host, exit_code=TIMED_OUT, tail=[*late.tail, "(timed out)"])
        time.sleep(0.1)
    return None


def _stop_all(running: list[Running]) -> list[Running]:
    """Stop the commands still running (SIGTERM, then SIGKILL after the grace period); returns them."""
    alive = [r for r in running if r.process.poll() is None]
    for run in alive:
        _signal_tree(run.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_SECONDS
    for run in alive:
        try:
            run.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_tree(run.process.pid, signal.SIGKILL)
            run.process.wait()
    return alive


def _clean_up(stopped: list[Running], output: Callable[[str], None]) -> None:
    """Run the cleanup of every stopped command that has one, side by side; relay what they say."""
    cleanups = [(r.command.host, r.command.cleanup, r.command.env) for r in stopped if r.command.cleanup]
    if not cleanups:
        return
    procs = [
        (host, argv, subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for host, argv, env in cleanups
    ]  # fmt: skip
    for host, argv, proc in procs:
        try:
            said, _ = proc.communicate(timeout=_CLEANUP_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            said, _ = proc.communicate()
        for line in said.decode(errors="replace").splitlines():
            output(f"[{host}] {line}")
        if proc.returncode != 0:
            output(f"[{host}] could not check for processes the job left (exit status {proc.returncode} "
                   f"from {argv[0]}); look for its torchrun agents there")  # fmt: skip


def _signal_tree(root: int, signum: int) -> None:
    """Signal a process and all its descendants.

    pdsh puts each of its ssh clients in a process group of its own, so signalling the group
    the supervisor created is not enough: every ssh client must end for its remote agent to get
    the hang-up that stops it.
    """
    for pid in [root, *_descendants(root)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # /proc/PID/stat: "pid (comm) state ppid ..."; comm may contain spaces and parentheses.
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found
