"""The CPU time each test costs, its processes' and theirs together, in the JUnit report.

On two cores the suite's wall time is bound by CPU time, and most of a test's is spent in the
processes it starts (a ``sail launch`` starts three that import torch), which the test's own wall
time does not show when another lane shares the cores. scripts/test.sh starts each lane in a cgroup
v1 ``cpuacct`` group of its own, which every process the lane starts inherits (the namespace
cluster's daemons and what they run included), and sets ``SAIL_TEST_CPU_TIME=1``; each test then
gets the group's CPU seconds over its setup, call and teardown as the ``cpu_seconds`` property of its
report (``scripts/suite_check.py slowest`` lists the costliest). In a pytest process outside such a
group it records nothing.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
ENABLE = "SAIL_TEST_CPU_TIME"


def _own_group() -> Path | None:
    """This process's cpuacct group, when it is one of its own (not the machine's root group)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(",") and path != "/":
            usage = CPUACCT / path.lstrip("/") / "cpuacct.usage"
            return usage if usage.exists() else None
    return None


_USAGE: list[Path] = []


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(ENABLE) == "1":
        _USAGE[:] = [usage] if (usage := _own_group()) is not None else []


def _seconds(usage: Path) -> float:
    return int(usage.read_text()) / 1e9


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    if _USAGE:  # the report turns the property into text as the teardown's report is written
        item.user_properties.append(("cpu_seconds", _Since(_USAGE[0], _seconds(_USAGE[0]))))
    return (yield)


class _Since:
    """The group's CPU seconds since ``before``, read when the report writes them."""

    def __init__(self, usage: Path, before: float) -> None:
        self.usage, self.before = usage, before

    def __str__(self) -> str:
        return f"{_seconds(self.usage) - self.before:.2f}"
