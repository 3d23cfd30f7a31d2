"""The ranks' progress records: pages of anonymous shared memory that the node's hang watch holds
open, so a store never waits for a disk (``tests/monitor/test_hang.py`` stalls one under a running
job), nothing is left in any filesystem however the job ends, and no other user can read them."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import resource
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from spikingsail.errors import SailError
from spikingsail.monitor import hangwatch, heartbeat
from tests.multiprocess import run_ranks
from tests.neighbour import python_as_neighbour

NAMED = "sail-heartbeat"

READ = """
import json, sys
tried = {}
for path in sys.argv[1:]:
    try:
        with open(path, "rb") as f:
            tried[path] = f.read(8).hex()
    except OSError as err:
        tried[path] = type(err).__name__
print(json.dumps(tried))
"""


def _named_since(start: float) -> list[str]:
    """Entries of the old records' kind made since ``start`` in the places they used to be."""
    places = [Path("/dev/shm"), Path(tempfile.gettempdir())]
    return [
        str(p)
        for place in places
        if place.is_dir()
        for p in place.glob(f"{NAMED}*")
        if p.lstat().st_mtime >= start
    ]


def _started(kill_watch: bool, neighbour: bool) -> dict[str, Any]:
    """In a two-rank job: the hang watch's start, what this rank's record is and who holds it."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        beat, watch = heartbeat.start(rank=rank, world_size=2, timeout=60, report_dir=tempfile.gettempdir(),
                                      board_host=None)  # fmt: skip
        try:
            out: dict[str, Any] = {"path": beat.path, "target": os.readlink(beat.path), "pid": os.getpid()}
            if watch is not None:
                fds = Path(f"/proc/{watch.pid}/fd")
                out["watch_holds"] = sorted(
                    os.readlink(fd) for fd in fds.iterdir() if NAMED in os.readlink(fd)
                )
            paths: list[Any] = [None, None]
            dist.all_gather_object(paths, beat.path)
            if neighbour and rank == 0:
                out["neighbour"] = json.loads(python_as_neighbour(READ, *paths).stdout)
            dist.barrier()
            if kill_watch and watch is not None:  # as SLURM ends a step: SIGKILL to every process of it
                watch.kill()
                watch.wait()
            dist.barrier()
            return out
        finally:
            heartbeat.stop(watch)
            beat.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_the_records_have_no_name_and_the_watch_holds_them_open() -> None:
    start = time.time() - 1
    ranks = run_ranks(_started, 2, False, False)
    for rank, seen in ranks.items():
        assert seen["path"] == f"/proc/{seen['pid']}/fd/{seen['path'].rsplit('/', 1)[1]}"
        assert seen["target"].startswith(f"/memfd:{NAMED}-rank-{rank} "), seen  # no file of any filesystem
    # the node's watch (rank 0's) opened both ranks' records: it reads them after a rank has ended
    assert ranks[0]["watch_holds"] == [f"/memfd:{NAMED}-rank-{r} (deleted)" for r in (0, 1)]
    assert "watch_holds" not in ranks[1]
    assert _named_since(start) == []


def test_the_watch_reads_a_record_after_its_rank_let_go_and_names_one_it_cannot_open(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fd = os.memfd_create("record")
    os.write(fd, b"step 7")
    missing = "/proc/self/fd/999999"
    with caplog.at_level(logging.WARNING):
        held = hangwatch._held({"0": f"/proc/{os.getpid()}/fd/{fd}", "1": missing})
    os.close(fd)  # the rank's own end
    try:
        assert Path(held["0"]).read_bytes() == b"step 7"
        assert held["1"] == missing
        assert f"cannot read rank 1's progress record {missing}" in caplog.text
        assert "no hang will be reported" in caplog.text
    finally:
        os.close(int(held["0"].rsplit("/", 1)[1]))


@pytest.mark.multiprocess
def test_a_watch_killed_outright_leaves_nothing_behind() -> None:
    """SLURM ends a failed, cancelled or preempted step with SIGKILL to all of its processes, the
    watch's included: records it had to remove itself stayed in /dev/shm until the node rebooted."""
    start = time.time() - 1
    run_ranks(_started, 2, True, False)
    assert _named_since(start) == []


@pytest.mark.multiprocess
def test_another_user_cannot_read_the_records() -> None:
    seen = run_ranks(_started, 2, False, True)[0]["neighbour"]
    assert len(seen) == 2 and set(seen.values()) == {"PermissionError"}, seen


def test_a_page_past_the_file_size_limit_is_refused_by_the_kernel() -> None:
    """``ulimit -f 0``: a memfd page counts against it, and making the record fails (EFBIG)."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    before = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the limit's signal ends the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, limit[1]))
    try:
        with pytest.raises(OSError, match="File too large"):
            heartbeat.Heartbeat(0, stacks=False)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, before)


def _start_with_a_refused_record(failing_rank: int) -> str:
    """In a two-rank job: the hang watch's start, where the kernel refuses one rank's record. The
    refusal is the kernel's answer (ENOMEM) at ``memfd_create`` on that rank only: a real limit
    (``ulimit -f 0``, no descriptor left) would hold for the rest of the process too, its sockets and
    writes, while the test's ranks still talk."""
    dist.init_process_group("gloo")
    try:
        if dist.get_rank() == failing_rank:

            def refused(name: str, flags: int = 0) -> int:
                raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

            os.memfd_create = refused  # type: ignore[assignment]
        try:
            beat, watch = heartbeat.start(rank=dist.get_rank(), world_size=2, timeout=5,
                                          report_dir=tempfile.gettempdir(), board_host=None)  # fmt: skip
        except SailError as err:
            return str(err)
        heartbeat.stop(watch)
        beat.close()
        return "started"
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_a_record_that_cannot_be_made_stops_every_rank_saying_which_and_why() -> None:
    said = run_ranks(_start_with_a_refused_record, 2, 1)
    for text in said.values():  # both ranks: the other one does not wait for a watch that never comes
        assert text.startswith("sail.hang_timeout_seconds: rank 1 on "), said
        assert "cannot make its progress record" in text and "Cannot allocate memory" in text, said
        assert "sail.hang_timeout_seconds to 0" in text, said


def _watch_where_memfd_is_missing() -> tuple[str, list[str]]:
    """In a two-rank job: the engine's hang watch on a platform without ``memfd_create``."""
    from spikingsail.config.schema import SailSection
    from spikingsail.engine import features
    from spikingsail.engine.state import StepCounters
    from spikingsail.environments import RankInfo

    dist.init_process_group("gloo")
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("spikingsail.engine.features").addHandler(handler)
    heartbeat.AVAILABLE = False
    try:
        rank = dist.get_rank()
        info = RankInfo(rank=rank, local_rank=rank, world_size=2, local_world_size=2, master_addr="127.0.0.1",
                        master_port=0, source="torchrun")  # fmt: skip
        with contextlib.ExitStack() as closing:
            beat = features.hang_watch(
                SailSection(), info, StepCounters(accumulation=1), Path(tempfile.gettempdir()), closing
            )
        return type(beat).__name__, said
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_where_memfd_is_missing_the_watch_is_off_with_a_warning_not_a_crash() -> None:
    ranks = run_ranks(_watch_where_memfd_is_missing, 2)
    assert [name for name, _ in ranks.values()] == ["NoHeartbeat", "NoHeartbeat"]
    assert ranks[1][1] == [] and len(ranks[0][1]) == 1, ranks
    assert "the hang watch needs Linux (memfd_create and /proc); it is off here" in ranks[0][1][0]
