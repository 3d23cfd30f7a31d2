"""A short seeded run of ``benchmarks/chaos.py`` on the suite's two-node cluster: four faults, one of
each kind the shared cluster allows (a killed worker, a stopped one, a killed agent, a network cut),
against a fault-free run of the same job; nothing lost, repeated or left behind."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.cluster.harness import NamespaceCluster

pytestmark = [pytest.mark.cluster, pytest.mark.alone]
BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"


def test_a_seeded_stream_of_faults_is_survived_with_every_sample_once(
    cluster: NamespaceCluster, tmp_path: Path
) -> None:
    spec = importlib.util.spec_from_file_location("chaos", BENCHMARK)
    assert spec is not None and spec.loader is not None
    chaos = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = chaos  # its dataclasses look their module up there
    spec.loader.exec_module(chaos)
    kinds = ("kill-worker", "stop-worker", "kill-agent", "cut-network")
    found = chaos.chaos(cluster, tmp_path, seed=3, faults=4, epochs=6, kinds=kinds)
    summary = "\n".join(f"{k}: {v}" for k, v in found.items())
    print(summary)  # the numbers, in the log of a run with -s or a failure
    assert found["job survived every fault"], (
        summary + "\n" + (tmp_path / "chaos" / "output.txt").read_text()[-5000:]
    )
    assert found["faults injected"] >= 3, summary  # the job may end before the last
    assert found["ledger problems"] == [] and found["samples lost"] == found["samples repeated"] == 0, summary
    assert found["steps with other samples than the fault-free run's"] == 0, summary
    assert found["processes left on the nodes"] == 0, summary
    assert found["final weights max |chaos - fault-free|"] < 1e-4, summary
