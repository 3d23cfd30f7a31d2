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
from dataclasses import dataclass, field
from types import FrameType

from spikingsail.launchers.command import LaunchCommand

TAIL_LINES = 25
_GRACE_SECONDS = 15.0
_ROOT_CAUSE = re.compile(r"rank: (\d+) \(local_rank: (\d+)\)\s*\n?.*?exitcode\s*:\s*(-?\d+)", re.S)


@dataclass(slots=True)
class Running:
    command: LaunchCommand
    process: subprocess.Popen[bytes]
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))


@dataclass(kw_only=True, slots=True, frozen=True)
class Failure:
    host: str
    exit_code: int
    tail: list[str]

    def describe(self) -> str:
        text = "\n".join(self.tail)
        cause = _ROOT_CAUSE.search(text)
        rank = (
            f", rank {cause.group(1)} (local rank {cause.group(2)}) exited with {cause.group(3)}"
            if cause
            else ""
        )
        shown = "\n".join(f"    {line}" for line in self.tail[-12:])
        return (
            f"node {self.host} failed (agent exit status {self.exit_code}){rank}; its last output:\n{shown}"
        )


def supervise(commands: list[LaunchCommand]) -> tuple[int, Failure | None]:
    """Run all commands; returns (exit status, the first failure or None)."""
    running = [_start(c) for c in commands]
    relays = [threading.Thread(target=_relay, args=(r,), daemon=True) for r in running]
    for relay in relays:
        relay.start()
    stop: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        failure = _wait(running, stop)
    finally:
        _stop_all(running)
        for relay in relays:
            relay.join(timeout=5)
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


def _relay(run: Running) -> None:
    assert run.process.stdout is not None
    prefix = f"[{run.command.host}] "
    for raw in iter(run.process.stdout.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n").replace("\r", "")
        run.tail.append(line)
        sys.stdout.write(prefix + line + "\n")
        sys.stdout.flush()


def _wait(running: list[Running], stop: list[int]) -> Failure | None:
    while not stop:
        states = [(r, r.process.poll()) for r in running]
        for run, code in states:
            if code not in (None, 0):
                time.sleep(0.3)  # let the relay catch the last lines
                return Failure(host=run.command.host, exit_code=code, tail=list(run.tail))
        if all(code == 0 for _, code in states):
            return None
        time.sleep(0.1)
    return None


def _stop_all(running: list[Running]) -> None:
    alive = [r for r in running if r.process.poll() is None]
    for run in alive:
        _signal_group(run.process, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_SECONDS
    for run in alive:
        try:
            run.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(run.process, signal.SIGKILL)
            run.process.wait()


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)
