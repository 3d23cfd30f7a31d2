"""Exit statuses that SpikingSail's processes end with and that launchers and schedulers act on.

Torch-free, so that what writes a job script (``sail submit``) does not import the engine to know them;
and how the commands end (``exit_now``).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

PREEMPTED_EXIT_CODE = 75
"""A rank that was told to stop (SIGTERM, SIGUSR1) saved a checkpoint and ended: requeue the job
(EX_TEMPFAIL in sysexits.h: "try again later")."""


def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` as the interpreter's exit begins, less its last part. The
    threads are waited for and the atexit handlers run (logging's, temporary files' finalizers,
    torch's) as in any exit; what is skipped is freeing the process's objects module by module,
    which the operating system does at once: once torch is imported that teardown costs 0.6 CPU-s
    and, on a busy machine, seconds of wall time between a command's last word and its end."""
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's exit does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120  # as the interpreter reports a failed flush of its standard streams
    os._exit(code)
