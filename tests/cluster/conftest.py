"""The two-node test cluster, built once per test session and torn down after it."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.harness import NamespaceCluster


@pytest.fixture(scope="session")
def cluster() -> Iterator[NamespaceCluster]:
    workdir = Path(tempfile.mkdtemp(prefix="sail-cluster-"))
    test_cluster = NamespaceCluster(workdir)
    try:
        test_cluster.start()
        yield test_cluster
    finally:
        test_cluster.stop()


@pytest.fixture(scope="session")
def slurm(cluster: NamespaceCluster) -> NamespaceCluster:
    """The same two nodes with munge, slurmctld (node1) and a slurmd on each node."""
    cluster.start_slurm()
    return cluster
