"""A command a launcher will run: data first, so ``--dry-run`` and tests can read it."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import FrameType


@dataclass(kw_only=True, slots=True, frozen=True)
class LaunchCommand:
    host: str
    """Where the command runs; ``localhost`` for this machine."""
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Variables set on top of the launching environment."""
    node_failure: str | None = None
    """A regular expression for an output line saying that one of the command's nodes failed
    while the command runs on for the others (pdsh reports each host's exit as it happens);
    named groups ``host`` and ``code`` or ``signal``. The job is stopped at such a line."""
    cleanup: list[str] | None = None
    """Run when the command had to be stopped: ends what it may have left running on its hosts."""

    def render(self) -> str:
        assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        command = shlex.join(self.argv)
        return f"[{self.host}] {assignments + ' ' if assignments else ''}{command}"


def run_local(command: LaunchCommand, base_env: Mapping[str, str] | None = None) -> int:
    """Run a command on this machine, passing SIGINT/SIGTERM/SIGUSR1 on to it; returns its exit status."""
    env = {**(os.environ if base_env is None else base_env), **command.env}
    child = subprocess.Popen(command.argv, env=env)

    def forward(signum: int, _frame: FrameType | None) -> None:
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        return child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if child.poll() is None:
            child.kill()
            child.wait()


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
