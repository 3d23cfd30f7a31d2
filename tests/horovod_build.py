"""The tests that need Horovod wait for its build when scripts/test.sh builds it beside them.

A fresh machine has no Horovod wheel yet, and building one keeps both cores busy for about three
minutes. scripts/test.sh then builds it beside the first phase's tests, at a lower priority, and sets
``SAIL_TEST_HOROVOD_STATUS`` to a file that holds the build's exit status once it has ended. A test
marked ``horovod`` waits for that file before its timeout starts, and fails with the build's output
if the build failed. Without the variable (Horovod installed before the tests) nothing waits.

A test is marked ``horovod`` when its id names Horovod (its file, name or parameters: a Horovod
backend, horovodrun, a page on Horovod); a test that needs Horovod without naming it carries the
mark itself. The lanes run the marked tests once two fifths of the others have run
(tests/lanes.py), when the build is most likely over.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from pathlib import Path

import pytest

from tests.lanes import claims_here

STATUS = "SAIL_TEST_HOROVOD_STATUS"
WAIT_SECONDS = 1800  # the build alone takes about 3 minutes, beside the tests several more


def needs_horovod(item: pytest.Item) -> bool:
    return "horovod" in item.keywords


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "horovod" in item.nodeid.lower():
            item.add_marker(pytest.mark.horovod)


_FAILED = pytest.StashKey[str]()


def wait_for_the_build(status: Path) -> str | None:
    """Wait for the build to end; why the test cannot run, if it failed."""
    deadline = time.monotonic() + WAIT_SECONDS
    while not status.exists():
        if time.monotonic() > deadline:
            return f"Horovod's build beside the tests did not end within {WAIT_SECONDS} s: see {status}.log"
        time.sleep(1)
    code = status.read_text().strip()
    if code == "0":
        return None
    log = Path(f"{status}.log")
    output = log.read_text(errors="replace")[-4000:] if log.exists() else "(no output)"
    return f"this test needs Horovod, whose build beside the tests failed (status {code}):\n{output}"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outside pytest-timeout's: the wait is not the test's
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    status = os.environ.get(STATUS)
    if status and needs_horovod(item) and claims_here(item):
        failed = wait_for_the_build(Path(status))
        if failed:
            item.stash[_FAILED] = failed
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if _FAILED in item.stash:
        pytest.fail(item.stash[_FAILED], pytrace=False)
