"""What scripts/test.sh reports around the suite: what a test left behind, and where the time went.

    python scripts/suite_check.py snapshot FILE            what runs and is mounted before the suite
    python scripts/suite_check.py leftovers FILE           after it: processes started since, network
                                                           namespaces, mounts and shared memory (names in
                                                           /dev/shm) added since; exit 1 if any
    python scripts/suite_check.py slowest SECONDS XML...   the suite's wall time, its 25 slowest tests
                                                           and the 25 that cost the most CPU time

A process counts when it started after the snapshot and carries the snapshot's mark in its
environment (``SAIL_SUITE_MARK``, which test.sh exports, so every process the tests start inherits
it, unless a test gives it a bare environment); other work on the machine does not. Standard
library only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

MARK = "SAIL_SUITE_MARK"
NETNS_DIR = "/run/netns"
SHARED_MEMORY = Path("/dev/shm")  # noqa: S108 (only listed: what is left there is memory until a reboot)
# a process that is being stopped as the suite ends may take a moment to go
GRACE_SECONDS = float(os.environ.get("SAIL_SUITE_GRACE_SECONDS", "15"))


def _boot_ticks_now() -> int:
    return int(float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK"))


def _start_ticks(stat: str) -> int:
    return int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, after the command's name


def _processes(mark: str) -> dict[int, tuple[int, str]]:
    """pid -> (start time in clock ticks since boot, command line) of the live processes with ``mark``."""
    found, needle = {}, f"{MARK}={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if " Z " not in stat[stat.rindex(")") :][:4]:  # a zombie is its live parent's to reap
            found[int(entry.name)] = (_start_ticks(stat), cmdline)
    return found


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    return pids


def _netns() -> list[str]:
    try:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return []
    return sorted(line.split()[0] for line in listed.stdout.splitlines() if line.strip())


def _mounts() -> list[str]:
    """Mount points, but for /run/netns: ``ip netns add`` mounts it once and keeps it (its namespaces,
    mounted inside it, are counted as namespaces)."""
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return sorted(p for p in points if p != NETNS_DIR and not p.startswith(f"{NETNS_DIR}/"))  # a mount
    # over another at the same point (a small /dev/shm) is listed twice


def _shared_memory() -> list[str]:
    try:
        return sorted(entry.name for entry in SHARED_MEMORY.iterdir())
    except OSError:
        return []


def snapshot(path: Path) -> None:
    snap = {"mark": os.environ[MARK], "ticks": _boot_ticks_now(), "netns": _netns(), "mounts": _mounts(),
            "shm": _shared_memory()}  # fmt: skip
    path.write_text(json.dumps(snap))


def _left(before: dict[str, Any]) -> list[str]:
    ticks = int(before["ticks"])
    mine = _ancestors()
    processes = _processes(str(before["mark"]))
    left = [f"process {pid}: {cmd[:200]}" for pid, (started, cmd) in sorted(processes.items())
            if started >= ticks and pid not in mine]  # fmt: skip
    left += [f"network namespace {name}" for name in _netns() if name not in before["netns"]]
    added = Counter(_mounts()) - Counter(before["mounts"])
    left += [f"mount {point}" for point in sorted(added.elements())]
    left += [
        f"shared memory {SHARED_MEMORY / name}"
        for name in _shared_memory()
        if name not in before.get("shm", [])
    ]
    return left


def leftovers(path: Path) -> int:
    before = json.loads(path.read_text())
    deadline = time.monotonic() + GRACE_SECONDS
    left = _left(before)
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left = _left(before)
    if not left:
        print("suite: no process, network namespace, mount or shared memory left behind")
        return 0
    print(f"suite: {len(left)} thing(s) left behind by the tests (a test must stop what it starts):")
    for line in left:
        print(f"  {line}")
    return 1


def slowest(wall_seconds: float, reports: list[Path], count: int = 25) -> None:
    cases, cpu = [], []
    for report in reports:
        if not report.exists():  # a run that selected nothing, or that was killed
            continue
        for case in ET.parse(report).getroot().iter("testcase"):  # noqa: S314 (pytest wrote it here)
            name = f"{case.get('classname')}::{case.get('name')}"
            cases.append((float(case.get("time", 0)), name))
            cpu += [
                (float(p.get("value", 0)), name)
                for p in case.iter("property")
                if p.get("name") == "cpu_seconds"
            ]
    minutes, seconds = divmod(round(wall_seconds), 60)
    print(f"suite: {minutes} min {seconds} s wall time for the tests, {len(cases)} test(s)")
    print(f"suite: the {count} slowest (setup, call and teardown):")
    for spent, name in sorted(cases, reverse=True)[:count]:
        print(f"  {spent:8.1f} s  {name}")
    if cpu:  # tests/cpu_time.py: the test's processes and those they started, on every core
        total = sum(spent for spent, _ in cpu)
        print(f"suite: {total / 60:.0f} CPU-minutes in {len(cpu)} test(s); the {count} costliest:")
        for spent, name in sorted(cpu, reverse=True)[:count]:
            print(f"  {spent:8.1f} CPU-s  {name}")


def main(argv: list[str]) -> int:
    command, *rest = argv
    if command == "snapshot":
        snapshot(Path(rest[0]))
        return 0
    if command == "leftovers":
        return leftovers(Path(rest[0]))
    if command == "slowest":
        slowest(float(rest[0]), [Path(p) for p in rest[1:]])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
