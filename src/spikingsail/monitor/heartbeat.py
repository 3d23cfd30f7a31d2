"""Each rank's progress, published for its node's hang watch (``sail.hang_timeout_seconds``).

A rank writes a fixed-size record into a page of anonymous shared memory (``memfd_create``) when it
enters and leaves each of the engine's calls: its optimizer step and micro-step, the call, how many of
the engine's collectives it has entered (the watch notes when each record appeared). That is a few
stores into one page of memory — no system call, no clock read, no filesystem, and no collective that
could itself hang. The node's watch (``hangwatch``, a process of its own started by the node's lowest
rank) opens each record through ``/proc/PID/fd/N`` (which only this user can), reads the records and
decides, with the other nodes' watches, when the job has stopped making progress. The records have no
name in any filesystem: they go when the last process holding them ends, however it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import ipaddress
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch.distributed as dist

from spikingsail.errors import SailError
from spikingsail.monitor import board
from spikingsail.monitor.hangreport import (
    BACKWARD,
    BEATS,
    CLOSED,
    COLLECTIVES,
    FORWARD,
    INSIDE,
    LEFT,
    MICRO,
    OPTIMIZER,
    PHASE,
    PID,
    READY,
    RECORD,
    STEP,
    WAITING,
    WHERE,
)
from spikingsail.monitor.hangwatch import Spec

AVAILABLE = hasattr(os, "memfd_create")
"""The records are memfd pages, which the watch (reading ``/proc``) opens: Linux only."""

STACK_SIGNAL = signal.SIGUSR2
"""Without py-spy, the watch asks a rank for its Python stacks with this signal (faulthandler)."""


class Heartbeat:
    """This rank's record: ``enter(phase)`` and ``leave(step, micro_step)`` around each engine call."""

    def __init__(self, rank: int, *, stacks: bool) -> None:
        fd = os.memfd_create(f"sail-heartbeat-rank-{rank}", os.MFD_CLOEXEC)
        self._file = os.fdopen(fd, "r+b")
        os.ftruncate(fd, RECORD.size)  # zeros: no record yet
        self._map = mmap.mmap(fd, RECORD.size)
        self._words = memoryview(self._map).cast("q")
        """The record's words (``hangreport.PID`` …): a store is a write into the shared page."""
        self.path = _seen_by_others(fd)
        self._words[PID] = os.getpid()
        self._stacks: IO[str] | None = None
        self.stack_path = ""
        if stacks:  # no py-spy on this node: faulthandler answers the watch
            self._stacks = os.fdopen(
                os.memfd_create(f"sail-heartbeat-rank-{rank}.stacks", os.MFD_CLOEXEC), "w"
            )
            self.stack_path = _seen_by_others(self._stacks.fileno())
            faulthandler.register(STACK_SIGNAL, file=self._stacks, all_threads=True)
        self._write(READY, LEFT)

    def _write(self, phase: int, inside: int) -> None:
        words = self._words
        words[PHASE], words[WHERE] = phase, inside
        words[BEATS] += 1

    def enter(self, phase: int, *, collective: bool = False) -> None:
        """Entering an engine call; ``collective``: one that waits for the other ranks."""
        if collective:
            self._words[COLLECTIVES] += 1
        self._write(phase, WAITING if collective else INSIDE)

    def pulse(self) -> None:
        """Progress without a step: a long compilation (from a thread of the watch's own)."""
        self._words[BEATS] += 1

    def leave(self, step: int, micro_step: int) -> None:
        words = self._words
        words[STEP], words[MICRO], words[WHERE] = step, micro_step, LEFT
        words[BEATS] += 1

    # The engine's step hooks (``engine/hooks.py``): a training micro-step passes six, so each stores
    # its words itself, with no call of its own. ``counters`` (the engine's step counters) says where
    # a rank leaves a call. A boundary's backward and step wait for the other ranks (WAITING is
    # INSIDE + 1) and count as a collective.

    counters: Any = None

    def forward_begin(self) -> None:
        words = self._words
        words[PHASE], words[WHERE] = FORWARD, INSIDE
        words[BEATS] += 1

    def backward_begin(self, _loss: object, boundary: bool) -> None:
        words = self._words
        words[PHASE], words[WHERE] = BACKWARD, INSIDE + boundary
        words[COLLECTIVES] += boundary
        words[BEATS] += 1

    def step_begin(self, boundary: bool) -> None:
        words = self._words
        words[PHASE], words[WHERE] = OPTIMIZER, INSIDE + boundary
        words[COLLECTIVES] += boundary
        words[BEATS] += 1

    def forward_end(self, _boundary: bool = False) -> None:
        words, counters = self._words, self.counters
        words[STEP], words[MICRO], words[WHERE] = counters.global_steps, counters.micro_steps, LEFT
        words[BEATS] += 1

    backward_end = step_end = forward_end

    def close(self) -> None:
        if self._map.closed:
            return
        self._write(CLOSED, LEFT)
        self._words.release()
        self._map.close()
        self._file.close()
        if self._stacks is not None:
            faulthandler.unregister(STACK_SIGNAL)
            self._stacks.close()


class NoHeartbeat:
    """``hang_timeout_seconds: 0``, or a single process: nothing is published."""

    def enter(self, phase: int, *, collective: bool = False) -> None:
        pass

    def leave(self, step: int, micro_step: int) -> None:
        pass

    def close(self) -> None:
        pass


def py_spy() -> str | None:
    """py-spy next to this Python (a virtual environment's bin) or on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def start(
    *, rank: int, world_size: int, timeout: float, report_dir: str, board_host: str | None
) -> tuple[Heartbeat, subprocess.Popen[bytes] | None]:
    """Every rank's record, and each node's watch, started by the node's lowest rank. Collective.

    Rank 0's node's watch serves the board: on loopback when the job has one node, else on the
    address the other nodes reach ``board_host`` (the rendezvous' master address; this host's name
    without one) at. That address and the job's secret are handed to the other nodes with one more
    collective, over the job's own process group; each watch reads the secret from its standard input.
    """
    host = socket.gethostname()
    spy = py_spy()
    seen = resolve(board_host or host)
    beat: Heartbeat | None = None
    failed = ""
    try:
        beat = Heartbeat(rank, stacks=spy is None)
    except OSError as err:  # out of memory, of file descriptors, past a file-size limit
        failed = err.strerror or str(err)
    mine = (host, seen, seen and source_toward(seen), beat and beat.path, beat and beat.stack_path, failed)
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    if beat is None or any(e[5] for e in everyone):  # every rank stops, not only the one that failed
        if beat is not None:
            beat.close()
        bad = next(r for r, e in enumerate(everyone) if e[5])
        raise SailError(
            f"sail.hang_timeout_seconds: rank {bad} on {everyone[bad][0]} cannot make its progress record",
            f"{everyone[bad][5]}; the node's hang watch reads each rank's record from a page of shared memory",
            "lift the limit it names on that node (memory, open files, `ulimit -f`), "
            "or set sail.hang_timeout_seconds to 0 to train without the hang watch",
        )
    hosts = [str(h) for h, *_ in everyone]
    node_ranks = [r for r, h in enumerate(hosts) if h == host]
    spec = Spec(
        records={str(r): str(everyone[r][3]) for r in node_ranks},
        host=host,
        timeout=timeout,
        world_size=world_size,
        nodes=len(set(hosts)),
        board=None,
        bind="",
        report_dir=report_dir,
        py_spy=spy,
        stack_files={str(r): str(everyone[r][4]) for r in node_ranks if everyone[r][4]},
    )
    process: subprocess.Popen[bytes] | None = None
    shared = ["", ""]
    try:
        if rank == 0:
            others = [(seen, own) for h, seen, own, *_ in everyone if h != host]
            address = bind_address(
                board_host or host,
                [str(seen) for seen, _ in others if seen],
                [str(own) for _, own in others if own],
                nodes=spec.nodes,
            )
            secret = board.new_secret()
            process, port = _spawn(dataclasses.replace(spec, bind=address), secret, serves=True)
            shared = [board.join_address(address, port), secret]
        dist.broadcast_object_list(shared, src=0)
        if rank != 0 and rank == node_ranks[0]:
            process, _ = _spawn(dataclasses.replace(spec, board=shared[0]), shared[1], serves=False)
    except BaseException:
        stop(process)
        beat.close()
        raise
    return beat, process


def resolve(host: str) -> str | None:
    """The address this machine reaches ``host`` at (the first the resolver gives), or None."""
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, UnicodeError, IndexError):
        return None


def source_toward(address: str) -> str | None:
    """The address of this machine's interface that its packets to ``address`` leave from (a UDP
    socket's connect sends nothing), or None without a route."""
    try:
        family = socket.getaddrinfo(address, 0, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def bind_address(host: str, seen_by_others: Sequence[str], others: Sequence[str] = (), *, nodes: int) -> str:
    """Where rank 0's node's board listens: loopback for a single node; else the first address of
    this machine that the other nodes resolve ``host`` to, or that this machine does, or (``host``
    naming a forwarder, such as a cluster's service address) this machine's interface towards the
    other nodes' own addresses (``others``). Never all interfaces, and never loopback when other
    nodes must reach it."""
    if nodes == 1:
        return "127.0.0.1"
    mine: list[str] = []
    with contextlib.suppress(OSError, UnicodeError):
        mine = [str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]
    towards = [a for a in map(source_toward, others) if a]
    tried = list(dict.fromkeys([*seen_by_others, *mine, *towards]))
    for address in tried:
        if not ipaddress.ip_address(address.partition("%")[0]).is_loopback and _is_mine(address):
            return address
    raise SailError(
        "sail.hang_timeout_seconds: no address of this node for the hang watch's board",
        f"the other nodes reach {host} at {', '.join(seen_by_others) or 'no address'} and this node resolves "
        f"it to {', '.join(mine) or 'nothing'}: none is an address of this node's own interfaces (the board "
        "listens on the job's interface only, never on all of them)",
        "launch with --rdzv-endpoint (or MASTER_ADDR) naming this node by an address of its interface, "
        "or set sail.hang_timeout_seconds to 0 to train without the hang watch",
    )


def _is_mine(address: str) -> bool:
    """Whether this machine can listen on ``address`` (it is one of its interfaces' addresses)."""
    try:
        family = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
        return True
    except OSError:
        return False


def _seen_by_others(fd: int) -> str:
    """The path this process's ``fd`` has for its node's watch: /proc gives it to this user alone."""
    return f"/proc/{os.getpid()}/fd/{fd}"


def _spawn(spec: Spec, secret: str, *, serves: bool) -> tuple[subprocess.Popen[bytes], int]:
    # A session of its own: a signal to the rank's process group (a terminal's Ctrl-C, a kill of the
    # group) must not end the watch before it has cleaned up; it ends when its rank does (stdin).
    # The secret is the first line of its standard input: never on a command line, which every
    # local user can read, nor in an environment its children would inherit.
    process = subprocess.Popen(
        spec.argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE if serves else None, start_new_session=True
    )
    assert process.stdin is not None
    try:
        process.stdin.write(secret.encode() + b"\n")
        process.stdin.flush()
    except OSError:
        pass  # it ended already: said below, or by its rank's next look
    if not serves:
        return process, 0
    assert process.stdout is not None
    line = process.stdout.readline().decode().strip()
    if not line.isdigit():
        process.kill()
        raise SailError(
            "sail.hang_timeout_seconds: the hang watch did not start",
            f"it said {line!r}" if line else "it ended without a word; its error is above",
            "set sail.hang_timeout_seconds to 0 to train without it",
        )
    return process, int(line)


def stop(process: subprocess.Popen[bytes] | None) -> None:
    """At close: a watch ends when its standard input does, after posting its ranks' last records."""
    if process is None:
        return
    try:
        if process.stdin is not None:
            process.stdin.close()
        process.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        process.kill()
        process.wait()
