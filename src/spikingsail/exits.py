"""Exit statuses that SpikingSail's processes end with and that launchers and schedulers act on.

Torch-free, so that what writes a job script (``sail submit``) does not import the engine to know them.
"""

from __future__ import annotations

PREEMPTED_EXIT_CODE = 75
"""A rank that was told to stop (SIGTERM, SIGUSR1) saved a checkpoint and ended: requeue the job
(EX_TEMPFAIL in sysexits.h: "try again later")."""
