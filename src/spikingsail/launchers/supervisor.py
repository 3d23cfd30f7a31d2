"""Run a job's commands side by side and stop all of them as soon as one fails.

Each command's output is relayed line by line with its host as prefix, and the last lines are
kept so that a failure can be reported with the host, the rank torchrun names, the exit status
and what the failing node printed last (``failure``).

The signals torchrun handles and SIGUSR1 are passed on to the job, not acted on here: to the
agents of ssh and pdsh commands through each host's tether, which is connected already
(``LaunchCommand.passes_signals``), or over a new connection where a host has none
(``LaunchCommand.relay``); or to the command itself where it passes them on (srun, mpirun). The
job then has ``DRAIN_SECONDS`` to end (workers save a checkpoint on SIGTERM and SIGUSR1) before
what is left is stopped; a second signal stops it at once (``supervision.watch``, the loop every
launch path runs under). Nothing the job started outlives the supervisor.
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

from spikingsail.launchers.command import LaunchCommand, Upload
from spikingsail.launchers.failure import Failure
from spikingsail.launchers.lifeline import AGENT_GRACE_SECONDS, TETHER_READY, Watchdog, descendants
from spikingsail.launchers.node_output import NodeOutput, torch_noise
from spikingsail.launchers.supervision import TIMED_OUT, Signals, watch

TAIL_LINES = 400
_GRACE_SECONDS = 15.0
# A cleanup waits out the agents' own grace period, plus time to connect.
_CLEANUP_SECONDS = AGENT_GRACE_SECONDS + 45.0
# torchrun's agent gives its workers 30 s to stop on a signal before it kills them.
DRAIN_SECONDS = 45.0
_UPLOAD_SECONDS = 60.0
HEARTBEAT_SECONDS = 1.0
# How long the tethers have to end on ``done`` before sail stops their connections.
_TETHER_DONE_SECONDS = 5.0
_SSH_FAILED = 255  # ssh's own exit status: the connection failed (ServerAlive checks unanswered)


@dataclass(slots=True)
class Running:
    command: LaunchCommand
    process: subprocess.Popen[bytes]
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    failed_node: tuple[str, int] | None = None
    """(host, exit status) of a node the command reported failed while it runs on."""
    connected: bool = False
    """A heartbeat command's tether answered: the connection to its host stood."""


def print_line(line: str) -> None:
    with contextlib.suppress(OSError):  # a closed terminal (SIGHUP) must not stop the relays
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
    command is stopped and the job fails with exit status 124, as timeout(1) does. A job stopped by
    a signal returns 128 + its number, as a shell reports it.
    """
    with Signals() as signals:
        failed_upload = _upload(commands)
        if failed_upload is not None or signals.received:
            _clean_up(commands, output)  # removes what did arrive; nothing was started
            if failed_upload is not None:
                return failed_upload.exit_code, failed_upload
            assert signals.status is not None  # a signal came while uploading
            return signals.status, None
        return watch(_Commands(commands, output), signals, timeout)


class _Commands:
    """The commands of one job, side by side (``supervision.Job``): the first to fail stops them all."""

    drain_seconds: float | None = DRAIN_SECONDS

    def __init__(self, commands: list[LaunchCommand], output: Callable[[str], None]) -> None:
        self._output = output
        self._failure: Failure | None = None
        self._watchdog = Watchdog()  # ends the commands' trees should this process die of SIGKILL
        self._running: list[Running] = []
        for command in commands:
            self._running.append(_start(command))
            self._watchdog.watch(self._running[-1].process.pid)
            if command.cleanup:
                self._watchdog.clean_up_with(command.cleanup, _environment(command))
        self._relays = [threading.Thread(target=_relay, args=(r, output), daemon=True) for r in self._running]
        for relay in self._relays:
            relay.start()
        self._heartbeat = _Heartbeat([r for r in self._running if r.command.heartbeat])

    def forward(self, signum: int) -> None:
        _forward(self._running, signum, self._heartbeat)

    def ended(self, draining: bool) -> bool:
        if all(r.process.poll() is not None for r in self._running if not r.command.heartbeat):
            self._heartbeat.release()
        states = [(r, r.process.poll()) for r in self._running]
        if all(code is not None for _, code in states) and (draining or all(c == 0 for _, c in states)):
            return True
        if not draining:
            self._failure = _first_failure(states)
        return self._failure is not None

    def time_out(self) -> None:
        late = next(r for r in self._running if r.process.poll() is None)
        self._failure = Failure(host=late.command.host, exit_code=TIMED_OUT, tail=[*late.tail, "(timed out)"])

    def stop(self) -> None:
        # sail is here to end the job itself (and its cleanups name what they kill): the tethers,
        # for a lost or killed sail, stand down
        self._heartbeat.release()
        _let_tethers_end(self._running)
        stopped = _stop_all(self._running)
        for relay in self._relays:
            relay.join(timeout=5)
        _clean_up([r.command for r in stopped], self._output)
        self._watchdog.done()

    def status(self) -> tuple[int, Failure | None]:
        if self._failure is not None:
            return self._failure.exit_code or 1, self._failure
        return 0, None


def _upload(commands: list[LaunchCommand]) -> Failure | None:
    """Send every command's uploads, all at once; the first that failed, if any."""
    uploads = [u for c in commands for u in c.uploads]
    started = [
        (upload, subprocess.Popen(upload.argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, start_new_session=True))
        for upload in uploads
    ]  # fmt: skip
    failure = None
    for upload, process in started:
        code, said = _send(upload, process)
        if code != 0 and failure is None:
            lines = [*said.splitlines()[-5:], f"(could not send the environment to {upload.host})"]
            failure = Failure(host=upload.host, exit_code=code, tail=lines)
    return failure


def _send(upload: Upload, process: subprocess.Popen[bytes]) -> tuple[int, str]:
    try:
        _, said = process.communicate(upload.text.encode(), timeout=_UPLOAD_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        _, said = process.communicate()
        return TIMED_OUT, f"no answer within {_UPLOAD_SECONDS:.0f} s"
    return process.returncode, said.decode(errors="replace")


def _start(command: LaunchCommand) -> Running:
    process = subprocess.Popen(
        command.argv,
        env=_environment(command),
        stdin=subprocess.PIPE if command.heartbeat else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # signals reach the children only through this supervisor
    )
    return Running(command=command, process=process)


def _environment(command: LaunchCommand) -> dict[str, str]:
    return dict(command.env) if command.clean_env else {**os.environ, **command.env}


def _relay(run: Running, output: Callable[[str], None]) -> None:
    assert run.process.stdout is not None
    prefix = f"[{run.command.host}] "
    node_failure = re.compile(run.command.node_failure) if run.command.node_failure else None
    shown = NodeOutput(host_prefixed=run.command.host_prefixed)
    for raw in iter(run.process.stdout.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n").replace("\r", "")
        if run.command.heartbeat and line == TETHER_READY:
            run.connected = True
            continue
        if not torch_noise(line):
            run.tail.append(line)
        for kept in shown.feed(line):
            output(prefix + kept)
        if node_failure is not None and run.failed_node is None and (found := node_failure.search(line)):
            run.failed_node = (found["host"], _exit_status(found.groupdict()))
    for kept in shown.end():
        output(prefix + kept)


def _exit_status(reported: dict[str, str | None]) -> int:
    """A shell's exit status for a reported exit code or signal (any other failure: 1)."""
    if reported.get("code"):
        return int(reported["code"] or 1)
    if reported.get("signal"):
        return 128 + int(reported["signal"] or 0)
    return 1


class _Heartbeat:
    """A line a second to each heartbeat command (``LaunchCommand.heartbeat``), from a thread of
    its own; ``done`` ends them once the job's other commands have ended."""

    def __init__(self, tethers: list[Running]) -> None:
        self._tethers = tethers
        self._lock = threading.Lock()
        self._over = threading.Event()
        if tethers:
            threading.Thread(target=self._beat, daemon=True).start()

    def _beat(self) -> None:
        while not self._over.wait(HEARTBEAT_SECONDS):
            self._send(b".\n", close=False)

    def release(self) -> None:
        """The job's commands have ended, or sail ends them itself: the tethers may end too."""
        if not self._over.is_set():
            self._over.set()
            self._send(b"done\n", close=True)

    def tell(self, tethers: list[Running], line: bytes) -> bool:
        """Write ``line`` to each of ``tethers``; whether every write went through (none is
        written when one of them is closed already)."""
        with self._lock:
            if any(run.process.stdin is None or run.process.stdin.closed for run in tethers):
                return False
            for run in tethers:
                assert run.process.stdin is not None
                try:
                    run.process.stdin.write(line)
                    run.process.stdin.flush()
                except OSError:
                    return False
        return True

    def _send(self, line: bytes, *, close: bool) -> None:
        with self._lock:
            for run in self._tethers:
                if run.process.stdin is None or run.process.stdin.closed:
                    continue
                with contextlib.suppress(OSError):  # an ended tether: its exit status tells
                    run.process.stdin.write(line)
                    run.process.stdin.flush()
                    if close:
                        run.process.stdin.close()


def _first_failure(states: list[tuple[Running, int | None]]) -> Failure | None:
    for run, code in states:
        if code not in (None, 0):
            time.sleep(0.3)  # let the relay catch the last lines
            lost = run.command.heartbeat_timeout if run.connected and code == _SSH_FAILED else None
            return Failure(host=run.command.host, exit_code=code, tail=list(run.tail), lost=lost)
        if run.failed_node is not None:
            host, node_code = run.failed_node
            time.sleep(0.3)
            return Failure(host=host, exit_code=node_code, tail=list(run.tail))
    return None


def _forward(running: list[Running], signum: int, heartbeat: _Heartbeat) -> None:
    """Pass a signal on to every command still running: through the tethers of its hosts, its
    relay, or to it directly."""
    name = signal.Signals(signum).name.removeprefix("SIG")
    tethers = {r.command.host: r for r in running
               if r.command.passes_signals and r.connected and r.process.poll() is None}  # fmt: skip
    for run in running:
        if run.process.poll() is not None or run.command.heartbeat:
            continue
        if run.command.relay is None:
            stand_in = run.command.stand_ins.get(f"SIG{name}", f"SIG{name}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(run.process.pid, signal.Signals[stand_in])
            continue
        hosts = run.command.host.split(",")  # pdsh: one command for several hosts
        if all(host in tethers for host in hosts) and heartbeat.tell(
            [tethers[host] for host in hosts], f"signal {name}\n".encode()
        ):
            continue
        relay = subprocess.Popen(
            [*run.command.relay, name],
            env=_environment(run.command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        # reaped by a thread: the main loop keeps watching the job meanwhile
        threading.Thread(target=_reap, args=(relay,), daemon=True).start()


def _reap(process: subprocess.Popen[bytes]) -> None:
    try:
        process.wait(timeout=_CLEANUP_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _let_tethers_end(running: list[Running]) -> None:
    """Give the tethers told ``done`` a moment to hear it and end by themselves.

    A tether whose connection is cut before ``done`` crossed it would end its node's part of the
    job by itself, and what it said would be lost with the connection; the cleanups, which name
    what they kill, would then find nothing left.
    """
    deadline = time.monotonic() + _TETHER_DONE_SECONDS
    for run in running:
        if run.command.heartbeat:
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.process.wait(timeout=max(0.0, deadline - time.monotonic()))


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


def _clean_up(stopped: list[LaunchCommand], output: Callable[[str], None]) -> None:
    """Run the cleanup of every stopped command that has one, side by side; relay what they say."""
    procs = [
        (c.host, c.cleanup, subprocess.Popen(c.cleanup, env=_environment(c), stdin=subprocess.DEVNULL,
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for c in stopped
        if c.cleanup
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
    for pid in [root, *descendants(root)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
