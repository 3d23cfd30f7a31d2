"""Each rank's progress, published for its node's hang watch (``sail.hang_timeout_seconds``).

A rank writes a fixed-size record into a small shared-memory file when it enters and leaves each of
the engine's calls: its optimizer step and micro-step, the call, how many of the engine's collectives
it has entered, and the time. That is a ``struct.pack_into`` into one page of memory — no system
call, and no collective that could itself hang. The node's watch (``hangwatch``, a process of its
own started by the node's lowest rank) reads the records and decides, with the other nodes'
watches, when the job has stopped making progress.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import mmap
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import IO, Any

import torch.distributed as dist

from spikingsail.errors import SailError
from spikingsail.monitor.hangwatch import (
    CLOSED,
    INSIDE,
    LEFT,
    READY,
    RECORD,
    WAITING,
    Spec,
)

STACK_SIGNAL = signal.SIGUSR2
"""Without py-spy, the watch asks a rank for its Python stacks with this signal (faulthandler)."""


class Heartbeat:
    """This rank's record: ``enter(phase)`` and ``leave(step, micro_step)`` around each engine call."""

    def __init__(self, path: Path, stack_path: Path | None) -> None:
        self._file = path.open("w+b")
        self._file.write(bytes(RECORD.size))
        self._file.flush()
        self._map = mmap.mmap(self._file.fileno(), RECORD.size)
        self._pid = os.getpid()
        self._beats = 0
        self._step = self._micro = 0
        self._phase = READY
        self._collectives = 0
        self._stacks: IO[str] | None = None
        if stack_path is not None:  # no py-spy on this node: faulthandler answers the watch
            self._stacks = stack_path.open("w")
            faulthandler.register(STACK_SIGNAL, file=self._stacks, all_threads=True)
        self._write(LEFT)

    def _write(self, inside: int) -> None:
        self._beats += 1
        RECORD.pack_into(self._map, 0, self._pid, self._beats, self._step, self._micro, self._phase,
                         inside, self._collectives, time.time())  # fmt: skip

    def enter(self, phase: int, *, collective: bool = False) -> None:
        """Entering an engine call; ``collective``: one that waits for the other ranks."""
        self._phase = phase
        if collective:
            self._collectives += 1
        self._write(WAITING if collective else INSIDE)

    def leave(self, step: int, micro_step: int) -> None:
        self._step, self._micro = step, micro_step
        self._write(LEFT)

    def close(self) -> None:
        if self._map.closed:
            return
        self._phase = CLOSED
        self._write(LEFT)
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

    Rank 0's node's watch serves the board; its address (``board_host``, else this host's name,
    and the port it chose) and a key are handed to the other nodes with one more collective.
    """
    host = socket.gethostname()
    spy = py_spy()
    mine = (host, uuid.uuid4().hex[:12] if rank == 0 else "")
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    hosts = [str(h) for h, _ in everyone]
    directory = Path(tempfile.gettempdir()) / f"sail-heartbeat-{everyone[0][1]}"
    directory.mkdir(mode=0o700, exist_ok=True)
    beat = Heartbeat(directory / f"rank-{rank}", None if spy else directory / f"rank-{rank}.stacks")
    node_ranks = [r for r, h in enumerate(hosts) if h == host]
    spec = Spec(
        records={str(r): str(directory / f"rank-{r}") for r in node_ranks},
        host=host,
        timeout=timeout,
        world_size=world_size,
        nodes=len(set(hosts)),
        board=None,
        authkey=secrets.token_hex(16),
        directory=str(directory),
        report_dir=report_dir,
        py_spy=spy,
        stack_files={str(r): str(directory / f"rank-{r}.stacks") for r in node_ranks},
    )
    process: subprocess.Popen[bytes] | None = None
    board = ["", ""]
    try:
        if rank == 0:
            process, port = _spawn(spec, serves=True)
            board = [f"{board_host or host}:{port}", spec.authkey]
        dist.broadcast_object_list(board, src=0)
        if rank != 0 and rank == node_ranks[0]:
            process, _ = _spawn(dataclasses.replace(spec, board=board[0], authkey=board[1]), serves=False)
    except BaseException:
        stop(process)
        beat.close()
        raise
    return beat, process


def _spawn(spec: Spec, *, serves: bool) -> tuple[subprocess.Popen[bytes], int]:
    # A session of its own: a signal to the rank's process group (a terminal's Ctrl-C, a kill of the
    # group) must not end the watch before it has cleaned up; it ends when its rank does (stdin).
    process = subprocess.Popen(
        spec.argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE if serves else None, start_new_session=True
    )
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
