"""A command a launcher will run: data first, so ``--dry-run`` and tests can read it."""

from __future__ import annotations

import shlex
import signal
import sys
from dataclasses import dataclass, field

from spikingsail.launchers.remote_env import export_lines, masked

# The signals torchrun's agent handles, plus SIGUSR1 (sbatch --signal=USR1@T, the engine's cue to
# save and exit 75): every launch path passes them on to the job.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
FORWARDED_SIGNALS = ",".join(s.name for s in FORWARDED)


@dataclass(kw_only=True, slots=True, frozen=True)
class Upload:
    """Variables sent to one host over ssh's standard input before the job starts: values never
    appear on a command line that ``ps`` shows, here or there."""

    host: str
    argv: list[str]
    """Reads standard input on the host into a file only the user can read."""
    env: dict[str, str]

    @property
    def text(self) -> str:
        return export_lines(self.env)


@dataclass(kw_only=True, slots=True, frozen=True)
class LaunchCommand:
    host: str
    """Where the command runs; ``localhost`` for this machine."""
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Variables set on top of the launching environment (values stay off the command line)."""
    clean_env: bool = False
    """Start from an empty environment: the command gets ``env`` only."""
    uploads: list[Upload] = field(default_factory=list)
    """Sent before ``argv`` starts; the job does not start unless every upload succeeded."""
    node_failure: str | None = None
    """A regular expression for an output line saying that one of the command's nodes failed
    while the command runs on for the others (pdsh reports each host's exit as it happens);
    named groups ``host`` and ``code`` or ``signal``. The job is stopped at such a line."""
    host_prefixed: bool = False
    """Each output line starts with the host it came from, ``host: `` (pdsh)."""
    cleanup: list[str] | None = None
    """Run when the command had to be stopped: ends what it may have left running on its hosts."""
    relay: list[str] | None = None
    """Passes a signal on to what the command started on other hosts, with the signal's name
    (``USR1``) appended as the last word. None: the command passes signals on itself (torchrun,
    mpirun), so the signal is sent to it."""
    stand_ins: dict[str, str] = field(default_factory=dict)
    """Signals the command would ignore, by name, and the one sent to it in their place."""
    heartbeat_timeout: float | None = None
    """Set for a heartbeat command (``agents.tether``): it reads a line a second on its standard
    input and ``done`` once every other command of the job has ended, and its ssh gives the host up
    after this many seconds without an answer. Signals are not passed on to it."""
    passes_signals: bool = False
    """A heartbeat command that also passes a signal on to the job's torchrun agents on its host
    when told ``signal NAME`` on its standard input: the supervisor sends the signals of a command
    with a ``relay`` that way when every host of the command has a connected one (no new
    connection to wait for, so every node gets the signal within the same moment)."""

    @property
    def heartbeat(self) -> bool:
        return self.heartbeat_timeout is not None

    def render(self) -> str:
        """The command as ``--dry-run`` prints it; values of credential-like names are masked."""
        lines = [
            f"[{upload.host}] environment, sent over ssh's standard input: {_assignments(upload.env)}"
            for upload in self.uploads
        ]
        prefix = "env -i " if self.clean_env else ""
        assignments = _assignments(self.env)
        lines.append(
            f"[{self.host}] {prefix}{assignments + ' ' if assignments else ''}{shlex.join(self.argv)}"
        )
        return "\n".join(lines)


def _assignments(env: dict[str, str]) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(masked(env).items()))


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
