"""tests/lanes.py, which shares a phase's tests out between scripts/test.sh's lanes: real pytest
processes side by side on generated test files, each test run exactly once in all."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = """
import pytest
pytest_plugins = ["tests.lanes"]

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        if "on_cluster" in item.name:
            item.add_marker(pytest.mark.cluster)

def pytest_configure(config):
    config.addinivalue_line("markers", "cluster: needs the one cluster")
    config.addinivalue_line("markers", "alone: a later phase's")
    config.addinivalue_line("markers", "speed: the last phase's")
"""

# Each file's module fixture records its set-up and tear-down, with the tests run between them: a
# lane that passes over another lane's file must still tear down what the file before it set up.
MODULE = """
import os, time, pytest
LOG = os.environ["LANES_LOG"]

def note(what):
    with open(LOG, "a") as f:
        f.write(f"{{os.getpid()}} {{what}}\\n")

@pytest.fixture(scope="module")
def resource():
    note("setup {name}")
    yield
    note("teardown {name}")

@pytest.mark.parametrize("n", range({count}))
def test_{name}(resource, n):
    note("run {name} %d" % n)
    time.sleep({sleep})

def test_{name}_on_cluster(resource):
    note("run {name} cluster")
"""


def write_tests(directory: Path, files: int = 6) -> None:
    (directory / "conftest.py").write_text(CONFTEST)
    for i in range(files):
        name = f"f{i}"
        (directory / f"test_{name}.py").write_text(MODULE.format(name=name, count=3, sleep=0.05 * (i % 3)))


def lane(
    directory: Path, share: str | None, by: str, marks: str, log: Path, xml: Path,
    later: Path | None = None, paths: list[str] | None = None,
) -> subprocess.Popen[str]:  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LANES_LOG": str(log), "SAIL_TEST_SHARE_BY": by}
    env.pop("SAIL_TEST_SHARE", None)
    env.pop("SAIL_TEST_LATER", None)
    if share:
        env["SAIL_TEST_SHARE"] = share
    if later:
        env["SAIL_TEST_LATER"] = str(later)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", marks,
               "--junitxml", str(xml), "--rootdir", str(directory), *(paths or [str(directory)])]  # fmt: skip
    return subprocess.Popen(command, cwd=directory, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


def ran(xml: Path) -> list[str]:
    return [case.get("name", "") for case in ET.parse(xml).iter("testcase")]


@pytest.mark.parametrize("by", ["file", "test"])
def test_lanes_side_by_side_run_every_test_once_and_the_cluster_lane_alone_runs_the_cluster_tests(
    tmp_path: Path, by: str
) -> None:
    tests, share, log = tmp_path / "suite", tmp_path / "share", tmp_path / "log"
    tests.mkdir()
    share.mkdir()
    write_tests(tests)
    lanes = [
        lane(tests, str(share), by, "not cluster", log, tmp_path / "a.xml"),
        lane(tests, str(share), by, "not cluster", log, tmp_path / "b.xml"),
        lane(tests, str(share), by, "", log, tmp_path / "cluster.xml"),
    ]
    for process in lanes:
        output, _ = process.communicate(timeout=120)
        assert process.returncode in (0, 5), output  # 5: this lane got no test at all
    by_lane = {name: ran(tmp_path / f"{name}.xml") for name in ("a", "b", "cluster")}
    every = [test for tests_run in by_lane.values() for test in tests_run]
    want = [f"test_f{i}[{n}]" for i in range(6) for n in range(3)] + [
        f"test_f{i}_on_cluster" for i in range(6)
    ]
    assert sorted(every) == sorted(want)
    assert {name for name in every if "cluster" in name} <= set(by_lane["cluster"])
    # per process, every module fixture is set up before its tests and torn down after them, once
    lines = [line.split(" ", 1) for line in log.read_text().splitlines()]
    for pid in {pid for pid, _ in lines}:
        open_modules: set[str] = set()
        for what in (w for p, w in lines if p == pid):
            verb, name, *_ = what.split()
            if verb == "setup":
                assert name not in open_modules and not open_modules, what  # the one before was torn down
                open_modules.add(name)
            elif verb == "teardown":
                open_modules.remove(name)
            else:
                assert name in open_modules, what
        assert not open_modules
    if by == "file":  # a file's tests (outside the cluster) all in one lane
        for i in range(6):
            assert sum(f"test_f{i}[0]" in tests_run for tests_run in by_lane.values()) == 1
            lanes_of_file = {
                x for x, tests_run in by_lane.items() for n in tests_run if n.startswith(f"test_f{i}[")
            }
            assert len(lanes_of_file) == 1


def test_without_a_share_a_lane_runs_everything_it_selects(tmp_path: Path) -> None:
    tests, log = tmp_path / "suite", tmp_path / "log"
    tests.mkdir()
    write_tests(tests, files=2)
    process = lane(tests, None, "file", "", log, tmp_path / "all.xml")
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert len(ran(tmp_path / "all.xml")) == 8


@pytest.mark.parametrize("in_suite", [True, False])
def test_a_lane_of_the_suite_keeps_pytests_rewritten_modules_for_the_next_even_without_bytecode(
    tmp_path: Path, in_suite: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under scripts/test.sh (SAIL_SUITE_MARK) a lane writes pytest's assertion-rewritten test modules,
    which later lanes read instead of rewriting, though PYTHONDONTWRITEBYTECODE is set; a plain pytest
    with that setting writes none."""
    tests, log = tmp_path / "suite", tmp_path / "log"
    tests.mkdir()
    write_tests(tests, files=2)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    if in_suite:
        monkeypatch.setenv("SAIL_SUITE_MARK", "lanes-test")
    else:
        monkeypatch.delenv("SAIL_SUITE_MARK", raising=False)
    process = lane(tests, None, "file", "", log, tmp_path / "all.xml")
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    rewritten = sorted(p.name.split(".")[0] for p in tests.glob("__pycache__/test_*-pytest-*.pyc"))
    assert rewritten == (["test_f0", "test_f1"] if in_suite else [])


def test_a_first_phase_lane_names_the_files_of_the_later_phases_tests_selected_or_not(tmp_path: Path) -> None:
    """With SAIL_TEST_LATER a lane writes the files that hold a test marked ``alone`` or ``speed``,
    whether its -m selected them or not: scripts/test.sh's later phases collect only those."""
    tests, log = tmp_path / "suite", tmp_path / "log"
    tests.mkdir()
    write_tests(tests, files=3)
    (tests / "test_f0.py").write_text(
        "import pytest\npytestmark = pytest.mark.alone\n" + (tests / "test_f0.py").read_text()
    )
    source = (tests / "test_f2.py").read_text()
    (tests / "test_f2.py").write_text(source + "\n@pytest.mark.alone\ndef test_one_alone():\n    pass\n")
    (tests / "speed").mkdir()  # a speed test's file, in a directory of its own
    (tests / "speed" / "test_s.py").write_text(
        "import pytest\n\n@pytest.mark.speed\ndef test_s():\n    pass\n"
    )
    later = tmp_path / "later"
    for marks in ("not alone", "", "alone"):
        later.unlink(missing_ok=True)
        process = lane(tests, None, "file", marks, log, tmp_path / "all.xml", later=later)
        output, _ = process.communicate(timeout=120)
        assert process.returncode == 0, output
        assert later.read_text().splitlines() == ["speed/test_s.py", "test_f0.py", "test_f2.py"], marks
    # the later phase's lane, given those files, runs what it ran collecting them all (the last above)
    process = lane(tests, None, "file", "alone", log, tmp_path / "named.xml", paths=later.read_text().split())
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert sorted(ran(tmp_path / "named.xml")) == sorted(ran(tmp_path / "all.xml"))
