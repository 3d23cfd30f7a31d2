"""scripts/suite_check.py, which scripts/test.sh (CI) runs around the suite: a process, mount, network
namespace or shared memory a test leaves fails the run, naming it; the report names the slowest tests."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = [sys.executable, str(ROOT / "scripts" / "suite_check.py")]


def check(*args: str | Path, mark: str = "", grace: str = "3") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SAIL_SUITE_MARK": mark or secrets.token_hex(8), "SAIL_SUITE_GRACE_SECONDS": grace}
    return subprocess.run([*CHECK, *map(str, args)], capture_output=True, text=True, timeout=60, check=False,
                          env=env)  # fmt: skip


def start(*command: str, mark: str) -> subprocess.Popen[bytes]:
    """A process of the suite with ``mark``, in a session of its own, as a rank that outlived its test."""
    return subprocess.Popen(command, start_new_session=True, env={**os.environ, "SAIL_SUITE_MARK": mark})


def processes_listed(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The processes a leftovers check listed. Not its exit status: these tests share the machine's /dev/shm,
    mounts and namespaces with the other lane's tests, whose live ones are listed as added too (the test of
    those runs in a mount namespace of its own, below)."""
    return [line for line in result.stdout.splitlines() if line.strip().startswith("process ")]


def test_a_process_started_after_the_snapshot_and_left_running_fails_the_run(tmp_path: Path) -> None:
    before, mark = tmp_path / "before.json", secrets.token_hex(8)
    assert check("snapshot", before, mark=mark).returncode == 0
    left = start("sleep", "300", mark=mark)
    other = start("sleep", "301", mark=secrets.token_hex(8))  # another run's, or nobody's: not counted
    try:
        result = check("leftovers", before, mark=mark)
        assert result.returncode == 1, result.stdout
        assert f"process {left.pid}: sleep 300" in result.stdout
        assert "sleep 301" not in result.stdout
    finally:
        for process in (left, other):
            process.kill()
            process.wait()
    result = check("leftovers", before, mark=mark)  # the checker's ancestors are not leftovers
    assert processes_listed(result) == [], result.stdout


def test_a_process_that_ends_within_the_grace_is_not_a_leftover(tmp_path: Path) -> None:
    before, mark = tmp_path / "before.json", secrets.token_hex(8)
    check("snapshot", before, mark=mark)
    ending = start("sleep", "2", mark=mark)  # a job still being stopped as the suite ends
    try:
        assert processes_listed(check("leftovers", before, mark=mark, grace="15")) == []
    finally:
        ending.wait()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"),
                    reason="needs root, unshare and ip to mount and add a namespace in a private mount namespace")  # fmt: skip
def test_a_mount_a_network_namespace_and_shared_memory_left_behind_fail_the_run(tmp_path: Path) -> None:
    """In a mount namespace of its own (a private /run/netns and /dev/shm), so other tests' mounts,
    namespaces and shared memory, made meanwhile beside this one, are not seen."""
    point = tmp_path / "left-mounted"
    point.mkdir()
    script = f"""
set -e
mount --make-rprivate /
mkdir -p /run/netns && mount -t tmpfs sail-netns /run/netns
mount -t tmpfs sail-shm /dev/shm && touch /dev/shm/there-before
{" ".join(CHECK)} snapshot {tmp_path}/before.json
{" ".join(CHECK)} leftovers {tmp_path}/before.json > {tmp_path}/clean.txt
mount -t tmpfs sail-left {point}
ip netns add sail-left-behind
touch /dev/shm/sail-left-behind
{" ".join(CHECK)} leftovers {tmp_path}/before.json
"""
    env = {**os.environ, "SAIL_SUITE_MARK": secrets.token_hex(8), "SAIL_SUITE_GRACE_SECONDS": "1"}
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                            check=False, env=env)  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"mount {point}" in result.stdout
    assert "network namespace sail-left-behind" in result.stdout
    assert "shared memory /dev/shm/sail-left-behind" in result.stdout
    assert "there-before" not in result.stdout
    # before anything was left, in the same namespace (the suite's other lane cannot add to it): a pass
    clean = (tmp_path / "clean.txt").read_text()
    assert clean == "suite: no process, network namespace, mount or shared memory left behind\n", clean


def test_the_slowest_tests_are_listed_from_every_runs_report(tmp_path: Path) -> None:
    reports = []
    for name, cases in {"rest": [("a", 1.5), ("b", 30.0)], "alone": [("c", 12.25)]}.items():
        xml = "".join(f'<testcase classname="tests.{name}" name="{n}" time="{t}"/>' for n, t in cases)
        report = tmp_path / f"{name}.xml"
        report.write_text(f'<testsuites><testsuite name="pytest">{xml}</testsuite></testsuites>')
        reports.append(report)
    result = check("slowest", "125", *reports, tmp_path / "cluster.xml")  # a run that wrote none
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "suite: 2 min 5 s wall time for the tests, 3 test(s)"
    assert [line.split()[-1] for line in lines[2:]] == ["tests.rest::b", "tests.alone::c", "tests.rest::a"]
