"""The test suite's own launcher (tests/multiprocess.py): workers forked from a forkserver must see
what a spawned worker would, the calling test's environment and the agent's rank variables."""

from __future__ import annotations

import os
import sys

import pytest

from tests.multiprocess import START_METHOD, run_ranks

pytestmark = pytest.mark.multiprocess


def environment() -> dict[str, str | None]:
    return {
        "rank": os.environ["RANK"],
        "world": os.environ["WORLD_SIZE"],
        "set": os.environ.get("SAIL_TEST_SET_BY_THE_TEST"),
        "removed": os.environ.get("SAIL_TEST_REMOVED_BY_THE_TEST"),
        "pid": str(os.getpid()),
        "spikingjelly": str("spikingjelly" in sys.modules),
    }


def test_workers_see_the_callers_environment_and_their_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    # a variable the forkserver saw when it started, then removed by the test: gone in the workers
    monkeypatch.setenv("SAIL_TEST_REMOVED_BY_THE_TEST", "1")
    run_ranks(environment, 1)  # the forkserver starts (if no earlier test started it) with the variable set
    monkeypatch.delenv("SAIL_TEST_REMOVED_BY_THE_TEST")
    monkeypatch.setenv("SAIL_TEST_SET_BY_THE_TEST", "yes")
    first, second = run_ranks(environment, 2), run_ranks(environment, 2)
    for ranks in (first, second):  # by rank: the agent hands the results back in the order the workers ended
        assert [(key, r["rank"], r["world"], r["set"], r["removed"]) for key, r in sorted(ranks.items())] == [
            (0, "0", "2", "yes", None), (1, "1", "2", "yes", None)]  # fmt: skip
    # fresh processes every launch, and only what every worker imports anyway is preloaded
    assert {r["pid"] for r in first.values()}.isdisjoint(r["pid"] for r in second.values())
    assert {r["spikingjelly"] for r in first.values()} == {"False"}, f"{START_METHOD} workers"
