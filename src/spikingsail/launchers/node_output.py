"""What ``sail launch`` shows of a node's output: every line, except two kinds of torch noise.

- c10d's "The hostname of the client socket cannot be retrieved" line, which torch prints at every
  connection of a node whose address has no reverse name, is explained once per ``sail`` process.
- The traceback torchrun's agent prints when it is stopped by a signal (a ``SignalException``:
  SIGTERM at a preemption, Ctrl-C) is one line: the stop was asked for, it is not a crash.

The local agent runs in a fork of ``sail`` and prints that line itself (``local``); a remote agent
is plain ``python -m torch.distributed.run``, so its traceback is folded here, where its output is
relayed. ``SAIL_LOG_LEVEL=DEBUG`` shows everything as printed.
"""

from __future__ import annotations

import re
import signal
import threading

from spikingsail.monitor.logs import debugging

_C10D_NO_NAME = re.compile(r"\[c10d\] The hostname of the client socket cannot be retrieved\. err=")
_C10D_EXPLAINED = (
    "sail: torch's c10d store found no name for a connecting node's address (a reverse DNS lookup "
    "failed; the line says so at every connection, and sail shows it no more): harmless, the store "
    "works by address; a PTR record or an /etc/hosts line for each node's address ends it"
)
_explained = threading.Event()
_TRACEBACK = "Traceback (most recent call last):"
_SIGNALLED = re.compile(
    r"^torch\.distributed\.elastic\.multiprocessing\.api\.SignalException: .* got signal: (\d+)$"
)
_HOST_PREFIX = re.compile(r"^([^\s:]+: )(.*)$")
_MAX_HELD = 500
"""A traceback longer than this many lines is shown as it is."""


def torch_noise(line: str) -> bool:
    """c10d's line for a connecting node without a reverse name: no part of what a node reports."""
    return _C10D_NO_NAME.search(line) is not None


def stopped_by(signum: int) -> str:
    """The line that stands for torchrun's traceback when a signal stopped it."""
    return (
        f"torchrun: stopped by {signal.Signals(signum).name}, which it passed on to the workers (with "
        "a checkpoint path they save and exit 75; the same command with --resume continues)"
    )


class NodeOutput:
    """One command's output lines in, the lines to show out. ``host_prefixed``: each line starts
    with the host it came from, ``host: `` (pdsh), and each host's lines are read apart."""

    def __init__(self, *, host_prefixed: bool = False) -> None:
        self._host_prefixed = host_prefixed
        self._held: dict[str, list[str]] = {}
        self._debug = debugging()

    def feed(self, line: str) -> list[str]:
        if self._debug:
            return [line]
        if torch_noise(line):
            if _explained.is_set():
                return []
            _explained.set()
            return [_C10D_EXPLAINED]
        host, body = "", line
        if self._host_prefixed and (found := _HOST_PREFIX.match(line)):
            host, body = found[1], found[2]
        held = self._held.get(host)
        if held is None:
            if body == _TRACEBACK:
                self._held[host] = [line]
                return []
            return [line]
        if body[:1] in (" ", "\t") and len(held) < _MAX_HELD:
            held.append(line)
            return []
        del self._held[host]
        if found := _SIGNALLED.match(body):
            return [host + stopped_by(int(found[1]))]
        return [*held, line]

    def end(self) -> list[str]:
        """The lines still held when the output ends (a traceback cut short)."""
        held = [line for lines in self._held.values() for line in lines]
        self._held.clear()
        return held
