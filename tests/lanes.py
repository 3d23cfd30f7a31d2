"""scripts/test.sh's lanes share out their tests as they go, instead of each running a fixed list.

Every lane of a phase is a pytest process that collects the same tests. With ``SAIL_TEST_SHARE`` set
to a directory, a lane runs a test only after claiming its unit there (a file created with
``O_EXCL``: exactly one lane gets it); a unit another lane claimed is passed over, not reported. The
unit is a test file by default (its module fixtures are set up once), or a single test with
``SAIL_TEST_SHARE_BY=test`` (for a phase of a few long tests). So a lane that finishes its share
early takes on work the other would have had, whatever this machine's speed.

With ``SAIL_TEST_LATER`` set to a file, a lane writes there the test files that hold a test marked
``alone`` or ``speed`` (selected or not): the later phases' lanes, which select only those tests, then collect
only those files (collecting all of them costs each lane about 12 CPU-s, four lanes in all).

The namespace cluster's tests are selected by one lane only (there is one cluster on the machine):
that lane runs them first, then claims the other units from the end of the list while the other
lanes claim from its start, so that the lanes meet rather than race for the same units.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

SHARE = "SAIL_TEST_SHARE"
SHARE_BY = "SAIL_TEST_SHARE_BY"
SUITE = "SAIL_SUITE_MARK"  # set by scripts/test.sh for all its lanes
LATER = "SAIL_TEST_LATER"
LATER_MARKS = ("alone", "speed")  # the marks the phases after the first select (scripts/test.sh)

# The lanes are pytest processes on one checkout: the first to import a test module keeps pytest's
# assertion-rewritten code of it (__pycache__/*-pytest-*.pyc) and the later ones read it, 3.7 of a
# lane's 11 s of collecting here. Where PYTHONDONTWRITEBYTECODE is set, every lane would rewrite
# every module; test.sh writes the checkout's bytecode anyway (the processes the tests start keep
# the setting).
if os.environ.get(SUITE):
    sys.dont_write_bytecode = False


def _unit(item: pytest.Item) -> str:
    by_test = os.environ.get(SHARE_BY) == "test"
    return item.nodeid if by_test else f"{item.nodeid.split('::')[0]} cluster={'cluster' in item.keywords}"


@pytest.hookimpl(trylast=True)  # after -m and -k have selected
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not os.environ.get(SHARE):
        return
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(_unit(item), []).append(item)

    def marked(unit: str, mark: str) -> bool:
        return any(mark in item.keywords for item in units[unit])

    # The units with a test that needs Horovod (tests/horovod_build.py: it may be being built) come
    # once two fifths of the others have run, not at the very end, where a long unit would leave one
    # lane alone at the last; the cluster lane runs its own such units last among its cluster units.
    plain = [unit for unit in units if not marked(unit, "horovod")]
    later = [unit for unit in units if marked(unit, "horovod")]
    cluster = [unit for unit in plain + later if marked(unit, "cluster")]
    others = [unit for unit in plain if unit not in cluster]
    cut = -(-len(others) * 2 // 5)  # rounded up
    forward = [*others[:cut], *(unit for unit in later if unit not in cluster), *others[cut:]]
    order = [*cluster, *reversed(forward)] if cluster else forward
    items[:] = [item for unit in order for item in units[unit]]


_DESELECTED: list[pytest.Item] = []


def pytest_deselected(items: list[pytest.Item]) -> None:
    _DESELECTED.extend(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    path = os.environ.get(LATER)
    if not path:
        return
    files = sorted({item.nodeid.split("::")[0] for item in [*session.items, *_DESELECTED]
                    if any(mark in item.keywords for mark in LATER_MARKS)})  # fmt: skip
    # every lane of the phase writes the same list: each its own file first, then renamed into place
    own = Path(f"{path}.{os.getpid()}")
    own.write_text("".join(f"{name}\n" for name in files))
    own.replace(path)


class _Claims:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.mine: set[str] = set()
        self.theirs: set[str] = set()

    def take(self, unit: str) -> bool:
        """Whether this lane runs ``unit``: it had it already, or claims it now."""
        if unit in self.mine:
            return True
        if unit in self.theirs:
            return False
        name = hashlib.sha256(unit.encode()).hexdigest()[:32]
        try:
            os.close(os.open(self.directory / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            self.theirs.add(unit)
            return False
        self.mine.add(unit)
        return True


_CLAIMS: dict[str, _Claims] = {}  # by directory


def claims_here(item: pytest.Item) -> bool:
    """Whether this lane runs ``item``: no lanes share the tests, or it has (or now claims) its unit."""
    directory = os.environ.get(SHARE)
    if not directory:
        return True
    if directory not in _CLAIMS:
        _CLAIMS[directory] = _Claims(Path(directory))
    return _CLAIMS[directory].take(_unit(item))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    if claims_here(item):
        return None  # pytest's own protocol runs it
    # another lane's: not run here; what the previous test left set up for it is torn down as the
    # test after it needs (pytest would have done so after running it)
    item.session._setupstate.teardown_exact(nextitem)
    return True
