"""A second, unprivileged local user: what another user of a shared login node can do to a job.

The account is created once (``useradd --system``, no home, no login shell) and kept; a test runs
code as it with ``setpriv`` (no PAM, no shell) under the system's Python with only its standard
library, as a neighbour without SpikingSail's environment would. The account cannot read root's
home, the job's environment (``/proc/PID/environ`` is the owner's) or a 0600 file.
"""

from __future__ import annotations

import fcntl
import pwd
import subprocess
import sys
from pathlib import Path

NAME = "sail-neighbour"
LOCK = Path("/run/lock" if Path("/run/lock").is_dir() else "/tmp") / f"{NAME}.lock"
PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


def neighbour() -> pwd.struct_passwd:
    """The account, created where it does not exist yet: by one process at a time (the suite's
    lanes are processes of their own; a second ``useradd`` of the name would fail)."""
    try:
        return pwd.getpwnam(NAME)
    except KeyError:
        pass
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return pwd.getpwnam(NAME)
        except KeyError:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", NAME],
                check=True, capture_output=True,
            )  # fmt: skip
            return pwd.getpwnam(NAME)


def as_neighbour(argv: list[str], *, timeout: float = 60, cwd: str = "/") -> subprocess.CompletedProcess[str]:
    """``argv`` run as the neighbour (its own uid and gid, no supplementary groups)."""
    user = neighbour()
    command = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--", *argv]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env={"PATH": "/usr/bin:/bin"}
    )


def python_as_neighbour(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Python ``code`` (standard library only) run as the neighbour; ``args`` are its ``sys.argv[1:]``."""
    return as_neighbour([PYTHON, "-I", "-c", code, *args], timeout=timeout)
