"""The one loop that supervises a launch, whatever runs it: torchrun's agent on this machine
(``local``), a multi-node job's commands (``supervisor``), or replica groups and their
lighthouse (``replicas``). Each of those is a ``Job``; ``watch`` runs it.

The loop is a small state machine, as torchrun's agent's own (``_invoke_run``)::

    RUNNING  --the job ended (done, or failed)---------------------------->  STOPPING
    RUNNING  --a signal: passed on (Job.forward)-------------------------->  DRAINING
    DRAINING --the job ended, its drain time passed, or a second signal--->  STOPPING
    RUNNING  --the timeout passed (Job.time_out)-------------------------->  STOPPING
    STOPPING --Job.stop(): what is left is stopped and cleaned up--------->  exit status

The signals torchrun handles and SIGUSR1 (``command.FORWARDED``) are recorded while the job runs
and passed on from the loop. The loop polls rather than blocking in a wait: the kernel may hand a
signal to any thread (a relay of the job's output), and Python runs its handler only when the main
thread next runs Python code; a main thread blocked in waitpid(2) would pass a closed terminal's
SIGHUP on only once the job ended. A job stopped by a signal ends with 128 + its number, as a shell
reports it, whatever the job's own status.
"""

from __future__ import annotations

import enum
import signal
import time
from types import FrameType, TracebackType
from typing import Protocol

from spikingsail.launchers.command import FORWARDED
from spikingsail.launchers.failure import Failure

POLL_SECONDS = 0.1
TIMED_OUT = 124


class Job(Protocol):
    """What ``watch`` supervises."""

    drain_seconds: float | None
    """After the first signal, how long the job has to end by itself before it is stopped; a second
    signal then stops it at once. None: every signal is passed on, and the job ends when it will
    (torchrun's agents give their workers 30 s)."""

    def forward(self, signum: int) -> None:
        """Pass a signal on to what is still running."""

    def ended(self, draining: bool) -> bool:
        """Whether the job has ended: every part of it done, or one failed (the job keeps which).
        ``draining``: a signal was passed on; what ends now ends on it, and is not restarted."""

    def time_out(self) -> None:
        """The timeout passed while the job ran: it fails with status 124, as timeout(1) does."""

    def stop(self) -> None:
        """Stop what still runs and clean up; runs however the loop ended, errors included."""

    def status(self) -> tuple[int, Failure | None]:
        """The job's exit status and its failure, once stopped (no signal came)."""


class State(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"
    STOPPING = "stopping"


class Signals:
    """While entered, the forwarded signals are recorded in ``received`` instead of acted on."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signum)

    def __enter__(self) -> Signals:
        self._previous = {s: signal.signal(s, self._record) for s in FORWARDED}
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]

    @property
    def status(self) -> int | None:
        """128 + the first signal's number, once one came."""
        return 128 + self.received[0] if self.received else None


def watch(job: Job, signals: Signals, timeout: float | None = None) -> tuple[int, Failure | None]:
    """Run ``job`` to its end under ``signals`` (entered); returns its exit status and failure."""
    deadline = None if timeout is None else time.monotonic() + timeout
    state, forwarded, drain_until = State.RUNNING, 0, None
    try:
        while state is not State.STOPPING:
            if len(signals.received) > forwarded:
                if state is State.DRAINING and job.drain_seconds is not None:
                    break  # a second signal: stop now
                job.forward(signals.received[forwarded])
                forwarded += 1
                state = State.DRAINING
                if job.drain_seconds is not None:
                    drain_until = time.monotonic() + job.drain_seconds
            if job.ended(draining=state is State.DRAINING):
                state = State.STOPPING
            elif drain_until is not None and time.monotonic() > drain_until:
                state = State.STOPPING  # the job did not end on the signal: stopped below
            elif deadline is not None and time.monotonic() > deadline:
                job.time_out()
                state = State.STOPPING
            else:
                time.sleep(POLL_SECONDS)
    finally:
        job.stop()
    if signals.status is not None:
        return signals.status, None
    return job.status()
