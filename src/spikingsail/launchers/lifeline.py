"""Nothing of a job outlives ``sail launch``, even when it dies of SIGKILL.

A signal ``sail launch`` can catch is passed on to the job (``supervisor``, ``local``). SIGKILL
cannot be caught, so:

- the local torchrun agent asks Linux for SIGTERM when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``, set in the child between fork and exec; a parent that died before
  the child could ask is noticed by the child's next look at its parent's pid). The agent then
  stops its workers.
- the multi-node launchers' commands (ssh, pdsh, mpirun, srun clients) are watched by a
  ``Watchdog`` process, which ends their whole process trees when sail is gone. An ssh client that
  ends closes its connection, and the remote agent, on a terminal of its own (``ssh -tt``), gets a
  hang-up and stops its workers; mpirun and srun end their ranks. Then the commands' cleanups run
  (horovodrun's: its remote ranks, started by ssh without a terminal, get no hang-up).
- a lost launching host (or a cut network) sends nothing at all: every node of an ssh or pdsh job
  (and every other host of an mpirun or horovodrun job) runs a ``tether`` over a connection of its
  own, which reads a heartbeat from sail and ends the node's torchrun agents (or ranks) when none
  came for the heartbeat timeout, or when the connection ended without sail saying the job is done.
  The same connection carries the signals sail passes on (``signal USR1``): a tether of an ssh or
  pdsh job sends them to its node's torchrun agents at once, with no new connection to make.

Linux only; elsewhere the children are started as before.

    python -I lifeline.py      (the watchdog: pids and "cleanup [ARGV, ENV]" JSON lines on stdin,
                                then "done"; standard library only)
    python -I lifeline.py tether JOB_REGEX TIMEOUT agents|ranks   (on a node: heartbeats, lines
                                "signal NAME", then "done")
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

_PR_SET_PDEATHSIG = 1
LIFELINE = str(Path(__file__).resolve())


def die_with_this_process(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``signum`` when this process dies.

    Linux sends it when the *thread* that started the child ends, so start such children from the
    main thread (the launcher's own loop), never from a helper thread.
    """
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        # runs in the child, after fork and before exec: only async-signal-safe work
        if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            os._exit(127)
        if os.getppid() != parent:  # the parent died before prctl: no signal would come
            os.kill(os.getpid(), signum)

    return arm


class Watchdog:
    """A process of its own that ends the commands ``sail launch`` started when sail dies without
    saying it is done (SIGKILL): the process tree of each, SIGTERM and then, after
    ``WATCHDOG_GRACE_SECONDS``, SIGKILL.

    ``prctl(PR_SET_PDEATHSIG)`` alone is not enough for the multi-node launchers: pdsh ends on
    SIGTERM and leaves its ssh clients (each in a process group of its own) connected, and mpirun
    writes to the dead launcher's pipe. The watchdog reads the commands' pids on a pipe from sail;
    the end of that pipe without ``done`` means sail is gone. It takes each tree as it is then (the
    ssh clients still under pdsh), and a process whose start time changed is not the one sail
    started.
    """

    def __init__(self) -> None:
        reader, self._writer = os.pipe()
        try:
            # this file as a script, in isolated mode (-I: not its directory on sys.path, whose
            # platform.py would shadow the standard library's): standard library only, no torch
            self.process = subprocess.Popen(
                [sys.executable, "-I", str(Path(__file__).resolve())],
                stdin=reader,
                start_new_session=True,  # a terminal's hang-up or Ctrl-C does not reach it
            )
        finally:
            os.close(reader)

    def watch(self, pid: int) -> None:
        with contextlib.suppress(OSError):
            os.write(self._writer, f"{pid}\n".encode())

    def clean_up_with(self, argv: list[str], env: dict[str, str]) -> None:
        """Run ``argv`` (with ``env``) after the trees ended, should sail die: it ends what the
        commands left on other hosts (horovodrun's remote ranks, which get no hang-up)."""
        with contextlib.suppress(OSError):
            os.write(self._writer, f"cleanup {json.dumps([argv, env])}\n".encode())

    def done(self) -> None:
        """The commands ended (or were stopped) under sail's own eyes: nothing for the watchdog to do."""
        with contextlib.suppress(OSError):
            os.write(self._writer, b"done\n")
            os.close(self._writer)
        self.process.wait()


WATCHDOG_GRACE_SECONDS = 10.0


def _stat(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after the command name (which may hold spaces and parentheses): state,
    ppid, ...; None for a process that is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 19 else None


def start_time(pid: int) -> str | None:
    """The process's start time (``/proc/PID/stat`` field 22), which tells it from a later one with the same pid."""
    fields = _stat(pid)
    return fields[19] if fields else None


def _parent(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def descendants(root: int) -> list[int]:
    """Every process below ``root``, by parent pid (``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        ppid = _parent(int(entry.name))
        if ppid is not None:
            children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _watch() -> None:
    started: dict[int, str | None] = {}
    cleanups: list[tuple[list[str], dict[str, str]]] = []
    for line in sys.stdin:
        word = line.strip()
        if word == "done":
            return
        if word.isdigit():
            started[int(word)] = start_time(int(word))
        elif word.startswith("cleanup "):
            argv, env = json.loads(word.removeprefix("cleanup "))
            cleanups.append((argv, env))
    # sail is gone: end what it started, whole trees, taken before anything is signalled
    targets = {}
    for root, when in started.items():
        if when is not None and start_time(root) == when:
            for pid in [root, *descendants(root)]:
                targets[pid] = start_time(pid)
    _signal(targets, signal.SIGTERM)
    deadline = time.monotonic() + WATCHDOG_GRACE_SECONDS
    while time.monotonic() < deadline and _alive(targets):
        time.sleep(0.1)
    _signal(targets, signal.SIGKILL)
    running = [subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL) for argv, env in cleanups]
    for process in running:
        try:
            process.wait(timeout=CLEANUP_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()


# A cleanup waits out the job's own grace period (15 s), plus time to connect.
CLEANUP_SECONDS = 60.0


def _alive(targets: dict[int, str | None]) -> dict[int, str | None]:
    """Those still running: the same start time, and not a zombie (a worker whose agent, stuck on
    an unreachable store, has not reaped it yet)."""
    alive: dict[int, str | None] = {}
    for pid, when in targets.items():
        fields = _stat(pid)
        if when is not None and fields and fields[19] == when and fields[0] not in ("Z", "X"):
            alive[pid] = when
    return alive


def _signal(targets: dict[int, str | None], signum: int) -> None:
    for pid in _alive(targets):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


# The tether's first line: sail knows the connection stands (a later ssh failure is a lost node).
TETHER_READY = "sail tether: watching"
# How long a node's torchrun agents have, after their connection was cut or a tether or cleanup
# sent them SIGTERM, to stop their workers before they are killed.
AGENT_GRACE_SECONDS = 15


def _tether(job_regex: str, timeout: float, kind: str) -> int:
    """Read heartbeats; on ``done`` return 0. On ``signal NAME`` (``USR1``) send that signal to the
    job's torchrun agents here (``kind`` ``agents``), which pass it to their workers. When no line
    came for ``timeout`` seconds, or the connection ended without ``done``, end this node's part of
    the job: SIGTERM to the job's processes found by ``job_regex`` on their command line in this
    network namespace (``kind``: torchrun ``agents``, or the ``ranks`` themselves) and to their
    children; once the workers (the agents' children, or the ranks) ended, at most
    ``AGENT_GRACE_SECONDS`` later, SIGKILL to what is left of their trees."""
    _say(TETHER_READY)
    last = time.monotonic()
    pending = b""
    while True:
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], 0.5)
        if ready:
            chunk = os.read(sys.stdin.fileno(), 4096)
            if not chunk:
                if pending.strip() == b"done":
                    return 0
                why = "the connection to sail launch ended"
                break
            *lines, pending = (pending + chunk).split(b"\n")
            pending = pending[-64:]
            for line in lines:
                if line == b"done":
                    return 0
                if line.startswith(b"signal ") and kind == "agents":
                    _pass_on(job_regex, line.removeprefix(b"signal ").decode(errors="replace"))
            last = time.monotonic()
        elif time.monotonic() - last > timeout:
            why = (
                f"no heartbeat from sail launch for {timeout:.0f} s (its host lost, or the network to it cut)"
            )
            break
    agents = _agents(re.compile(job_regex))
    _say(f"sail tether on {socket.gethostname()}: {why}; ending the job's processes here: {sorted(agents)}")
    targets = {pid: start_time(pid) for root in agents for pid in [root, *descendants(root)]}
    # The agents and their workers at once: an agent told alone stops its workers only after it
    # said goodbye to the rendezvous store, which on the lost host does not answer.
    working = {pid for pid in targets if _parent(pid) in agents} if kind == "agents" else set(agents)
    workers = {pid: targets[pid] for pid in working if pid in targets}
    _signal({pid: targets[pid] for pid in [*agents, *workers]}, signal.SIGTERM)
    deadline = time.monotonic() + AGENT_GRACE_SECONDS
    while time.monotonic() < deadline and _alive(workers):
        time.sleep(0.1)
    # the workers are done (or out of time): what is left, an agent waiting on the store, is killed
    settle = min(deadline, time.monotonic() + 1.0)
    while time.monotonic() < settle and _alive(targets):
        time.sleep(0.1)
    _signal(targets, signal.SIGKILL)
    return 1


def _pass_on(job_regex: str, name: str) -> None:
    """Send the signal ``name`` (``USR1``) to the job's torchrun agents in this network namespace,
    as ``agents.signal_relay`` does over a connection of its own."""
    signum = getattr(signal, f"SIG{name}", None)
    if not isinstance(signum, signal.Signals) or signum == signal.SIGKILL:
        _say(f"sail tether on {socket.gethostname()}: no signal named {name!r} to pass on")
        return
    for pid in _agents(re.compile(job_regex)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _say(line: str) -> None:
    """Tell sail, if the connection still carries it: never wait on a cut connection (a blocked
    write would hold up the ending of the job)."""
    with contextlib.suppress(OSError):
        os.set_blocking(sys.stdout.fileno(), False)
        os.write(sys.stdout.fileno(), f"{line}\n".encode())


def _agents(pattern: re.Pattern[str]) -> list[int]:
    """The processes in this network namespace whose command line matches ``pattern``."""
    here = os.readlink("/proc/self/ns/net")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            line = (
                (entry / "cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
            )
            if pattern.search(line) and os.readlink(entry / "ns" / "net") == here:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


if __name__ == "__main__":
    if sys.argv[1:2] == ["tether"]:
        sys.exit(_tether(sys.argv[2], float(sys.argv[3]), sys.argv[4]))
    _watch()
