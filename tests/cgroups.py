"""A process made slower for real: a cgroup v1 ``cpu`` group with a CPU quota."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")


@contextlib.contextmanager
def cpu_quota_group(percent: int) -> Iterator[Path]:
    """A cgroup v1 ``cpu`` group that gives its processes ``percent`` of one core, in 10 ms periods
    (so the slowdown is even, as on a slower device); a process joins by writing its pid to
    ``cgroup.procs``."""
    assert (CPU_CGROUPS / "cpu.cfs_quota_us").exists(), (
        f"the cgroup v1 cpu controller is not mounted at {CPU_CGROUPS}: these tests throttle a rank with it"
    )
    group = CPU_CGROUPS / f"sail-slow-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("10000")
        (group / "cpu.cfs_quota_us").write_text(str(percent * 100))
        yield group
    finally:
        for _ in range(50):  # the ranks have exited; the group empties as they are reaped
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
