"""Hygiene for every test (no leaked environment variables, no process group left behind), and the
session's two-node test cluster for the tests that ask for it."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.cgroups import cpu_quota_group
from tests.cluster.harness import NamespaceCluster
from tests.ninja import EXTENSIONS_DIR, NINJA_DIR


def pytest_configure(config: pytest.Config) -> None:
    """The environment is shared by the checkouts on this machine and scripts/setup.sh installs the one it
    runs in (editable): after another checkout's setup.sh, this one's tests, and every process they start,
    would import that checkout's code. Refused instead."""
    source = Path(__file__).resolve().parents[1] / "src"
    found = importlib.util.find_spec("spikingsail")
    if found is None or found.origin is None or not Path(found.origin).resolve().is_relative_to(source):
        pytest.exit(
            f"tests: `import spikingsail` finds {found.origin if found else 'nothing'}, not this checkout's "
            f"{source} (the environment is shared by the checkouts on this machine, and scripts/setup.sh "
            f"installs the one it ran in): run `bash scripts/setup.sh` here, or set PYTHONPATH={source}",
            returncode=4,
        )


# A helper module of several test files: its asserts say what differed, as a test module's do.
pytest.register_assert_rewrite("tests.fault.replicas")

# how scripts/test.sh's lanes share out the tests, the CPU time each test costs, and the wait for a
# Horovod built beside them
pytest_plugins = ["tests.lanes", "tests.cpu_time", "tests.horovod_build"]

# Set by others once per process: pytest's marker, torch's inductor cache path (exported the first
# time an optimizer step consults it) and OpenMP switches scikit-learn exports when imported.
_SET_BY_OTHERS = {
    "PYTEST_CURRENT_TEST",
    "TORCHINDUCTOR_CACHE_DIR",
    "KMP_DUPLICATE_LIB_OK",
    "KMP_INIT_AT_FORK",
    "PYTORCH_NVML_BASED_CUDA_CHECK",  # DeepSpeed sets it when imported
}

# DeepSpeed's JIT-compiled CPU ops, built once by scripts/setup.sh inside the environment (tests/ninja.py).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)
# ...compiled by one ninja in every process the tests start (tests/ninja.py).
os.environ["PATH"] = os.pathsep.join([NINJA_DIR, os.environ.get("PATH", "")])
# DeepSpeed reads the accelerator at import: CPU, as on this kind of machine.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# One intra-op thread per process, here and in every process a test starts (torchrun sets the same
# for its workers): the suite runs two pytest processes on two cores, each starting several
# processes at once, and each process's own thread pool on top only made them wait on each other
# (10 to 30 % more CPU time for the same test files, measured). A value the caller set stands.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``requires_cuda`` tests are skipped, with the reason, where torch sees no GPU. Every test on
    the namespace cluster is marked ``cluster``: scripts/test.sh runs them in a pytest process of
    their own (one cluster: the nodes' daemons, munge and slurm, are the machine's)."""
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False here")
    no_gpu = not torch.cuda.is_available()
    for item in items:
        if "requires_cuda" in item.keywords and no_gpu:
            item.add_marker(skip)
        if "_cluster_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection built (the test modules, torch's, dynamo's and hypothesis's) leaves the
    garbage collector's reach (``gc.freeze``): each full collection in this process then walks only
    what the tests made since, not a million objects that live as long as it does."""
    gc.collect()
    gc.freeze()


def pytest_report_header() -> str:
    from tests.matrix.cells import session_seed

    return f"differential matrix sample: SAIL_MATRIX_SEED={session_seed()}"


@pytest.fixture(autouse=True)
def _clean_process_state() -> Iterator[None]:
    before = dict(os.environ)
    yield
    leaked = {k for k in set(os.environ) ^ set(before)} | {
        k for k in before if os.environ.get(k) != before[k]
    }
    leaked -= _SET_BY_OTHERS
    os.environ.clear()
    os.environ.update(before)
    group_left = dist.is_initialized()
    if group_left:
        dist.destroy_process_group()
    assert not leaked, f"test changed environment variables: {sorted(leaked)}"
    assert not group_left, "test left a torch.distributed process group initialised"


@pytest.fixture(scope="session")
def _cluster_session() -> Iterator[NamespaceCluster]:
    workdir = Path(tempfile.mkdtemp(prefix="sail-cluster-"))
    test_cluster = NamespaceCluster(workdir)
    try:
        test_cluster.start()
        yield test_cluster
    finally:
        test_cluster.stop()


@pytest.fixture(scope="session")
def _slurm_session(_cluster_session: NamespaceCluster) -> NamespaceCluster:
    _cluster_session.start_slurm()
    return _cluster_session


@pytest.fixture
def cluster(_cluster_session: NamespaceCluster) -> Iterator[NamespaceCluster]:
    """The two-node test cluster (tests/cluster/harness.py), built once per test session."""
    yield _cluster_session
    _end_what_the_test_left(_cluster_session)


@pytest.fixture
def slurm(_slurm_session: NamespaceCluster) -> Iterator[NamespaceCluster]:
    """The same two nodes with munge, slurmctld (node1) and a slurmd on each node."""
    yield _slurm_session
    _end_what_the_test_left(_slurm_session)


def _end_what_the_test_left(test_cluster: NamespaceCluster) -> None:
    """Kill what a test left on the nodes (a failed one may leave its job running) so that the next
    test starts on clean nodes: one failure is reported once, not again by every later test that
    finds the port taken. Tests that launch jobs check for leftovers themselves, before this."""
    for pid in test_cluster.job_processes():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def slow_group() -> Iterator[Path]:
    """``cpu_quota_group`` at 40% of one core."""
    with cpu_quota_group(40) as group:
        yield group
