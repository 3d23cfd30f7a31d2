"""Children of ``sail launch`` that end when it dies, even of SIGKILL.

A signal ``sail launch`` can catch is passed on to the job (``supervisor``, ``local``). SIGKILL
cannot be caught, so each child the launcher starts for the job (the local torchrun agent; the ssh,
pdsh, mpirun and srun clients) asks Linux for a signal when its parent dies
(``prctl(PR_SET_PDEATHSIG)``), set in the child between fork and exec. The signal is SIGTERM:
torchrun's agent stops its workers on it, an ssh client closes its connection (the remote agent,
on a terminal of its own through ``ssh -tt``, gets a hang-up and stops its workers), mpirun and srun
end their ranks. A parent that died before the child could ask is noticed by the child's next look at
its parent's pid, and the child sends itself the signal.

Linux only; elsewhere the children are started as before.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


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
