"""tests/horovod_build.py: with Horovod being built beside the tests, a lane (a real pytest process on
generated test files) runs the tests that need it last, each after the build has ended and outside
its timeout, and fails them with the build's output where the build failed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = """
pytest_plugins = ["tests.lanes", "tests.horovod_build"]

def pytest_configure(config):
    config.addinivalue_line("markers", "horovod: needs Horovod")
"""

TEST = """
import os, time, pytest

def note(what):
    with open(os.environ["BUILD_LOG"], "a") as f:
        f.write(f"{{what}} {{time.monotonic()}}\\n")

{mark}
def test_{name}():
    note("{name}")
"""


def write_suite(directory: Path) -> None:
    directory.mkdir()
    (directory / "conftest.py").write_text(CONFTEST)
    (directory / "test_a_horovodrun.py").write_text(
        TEST.format(name="named", mark="")
    )  # its id names Horovod
    (directory / "test_b_plain.py").write_text(TEST.format(name="plain", mark=""))
    (directory / "test_c_marked.py").write_text(TEST.format(name="marked", mark="@pytest.mark.horovod"))


def lane(directory: Path, status: Path, log: Path) -> subprocess.Popen[str]:
    share = directory.parent / "share"
    share.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BUILD_LOG": str(log), "SAIL_TEST_SHARE": str(share),
           "SAIL_TEST_SHARE_BY": "file", "SAIL_TEST_HOROVOD_STATUS": str(status)}  # fmt: skip
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-o", "timeout=2",
               "--rootdir", str(directory), str(directory)]  # fmt: skip
    return subprocess.Popen(command, cwd=directory, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


def ran(log: Path) -> list[tuple[str, float]]:
    if not log.exists():
        return []
    return [(name, float(at)) for name, at in (line.split() for line in log.read_text().splitlines())]


def wait_for(condition: object, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_the_tests_that_need_horovod_run_last_once_its_build_has_ended_outside_their_timeout(
    tmp_path: Path,
) -> None:
    suite, status, log = tmp_path / "suite", tmp_path / "horovod.status", tmp_path / "log"
    write_suite(suite)
    process = lane(suite, status, log)
    wait_for(lambda: ran(log))
    time.sleep(3)  # past the tests' 2 s timeout: the wait is not theirs
    assert [name for name, _ in ran(log)] == ["plain"]  # the others wait for the build
    ended = time.monotonic()
    status.write_text("0")
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    order = ran(log)
    assert [name for name, _ in order] == ["plain", "named", "marked"]
    assert all(at > ended for name, at in order if name != "plain")


def test_a_failed_build_fails_the_tests_that_need_horovod_with_its_output(tmp_path: Path) -> None:
    suite, status, log = tmp_path / "suite", tmp_path / "horovod.status", tmp_path / "log"
    write_suite(suite)
    Path(f"{status}.log").write_text("cmake: no MPI found\n")
    status.write_text("2")
    process = lane(suite, status, log)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 1, output
    assert [name for name, _ in ran(log)] == ["plain"]
    assert "test_b_plain.py::test_plain PASSED" in output
    for test in ("test_a_horovodrun.py::test_named", "test_c_marked.py::test_marked"):
        assert f"{test} ERROR" in output, output
    assert (
        output.count("whose build beside the tests failed (status 2)") >= 2
        and "cmake: no MPI found" in output
    )
    assert "Traceback" not in output and "INTERNALERROR" not in output
