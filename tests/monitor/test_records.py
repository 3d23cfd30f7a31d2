"""Where the ranks' progress records live: in memory, so that a store never waits for a disk
(``tests/monitor/test_hang.py`` stalls a disk under a running job)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from spikingsail.errors import SailError
from spikingsail.monitor import heartbeat
from spikingsail.mounts import mount_of
from tests.multiprocess import run_ranks
from tests.tmpfs import mounted_tmpfs

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


def findmnt(path: Path) -> tuple[str, str]:
    """util-linux's answer: the mount point and type of the filesystem holding ``path``."""
    out = subprocess.run(
        ["findmnt", "-n", "-o", "TARGET,FSTYPE", "-T", str(path)], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], out[1]


@pytest.mark.parametrize("path", ["/", "/tmp", "/dev/shm", "/proc/self", "/sys/fs/cgroup", "/etc/hostname"])
def test_the_mount_holding_a_path_is_the_one_findmnt_names(path: str) -> None:
    found = mount_of(Path(path))
    assert found is not None
    assert (found.point, found.kind) == findmnt(Path(path))


def test_the_records_go_to_shared_memory() -> None:
    root = heartbeat.records_root()
    assert root == Path("/dev/shm")
    assert findmnt(root)[1] == "tmpfs"


def test_without_a_memory_filesystem_at_dev_shm_they_go_to_the_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert findmnt(tmp_path)[1] != "tmpfs"
    monkeypatch.setattr(heartbeat, "SHARED_MEMORY", tmp_path)
    assert heartbeat.records_root() == Path(tempfile.gettempdir())
    monkeypatch.setattr(heartbeat, "SHARED_MEMORY", tmp_path / "missing")
    assert heartbeat.records_root() == Path(tempfile.gettempdir())


def test_a_records_directory_that_is_not_this_users_own_stops_the_job(tmp_path: Path) -> None:
    """The watch kills the pids the records name: a directory of that name that another user made or
    can write into, or a link to one, is refused, naming what to remove."""
    assert heartbeat._private_directory(tmp_path / "mine") == tmp_path / "mine"  # made 0700
    assert heartbeat._private_directory(tmp_path / "mine") == tmp_path / "mine"  # ours already
    open_to_others, foreign, link = tmp_path / "open", tmp_path / "foreign", tmp_path / "link"
    open_to_others.mkdir(mode=0o700)
    open_to_others.chmod(0o733)
    foreign.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)
    link.symlink_to(tmp_path / "mine")
    for path in (open_to_others, *([foreign] if os.geteuid() == 0 else []), link):
        with pytest.raises(SailError) as refused:
            heartbeat._private_directory(path)
        assert f"{path} is not a private directory of this user" in str(refused.value)
        assert f"remove {path}" in str(refused.value)


@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KB tmpfs with no room left, as a container's /dev/shm that DataLoader workers filled."""
    with mounted_tmpfs(tmp_path / "shm", "64k") as mount:
        with contextlib.suppress(OSError), (mount / "filler").open("wb", buffering=0) as filler:
            while True:  # until ENOSPC
                filler.write(bytes(4096))
        yield mount


@root_only
def test_a_full_dev_shm_is_passed_over_for_the_temporary_directory(
    full_tmpfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert findmnt(full_tmpfs)[1] == "tmpfs"
    monkeypatch.setattr(heartbeat, "SHARED_MEMORY", full_tmpfs)
    assert heartbeat.records_root() == Path(tempfile.gettempdir())


def _start_with_records_in(root: str) -> str:
    """In a one-rank job: the hang watch's start, taking ``root`` for shared memory whatever its room."""
    dist.init_process_group("gloo")
    try:
        heartbeat.SHARED_MEMORY, heartbeat.SHARED_MEMORY_FREE = Path(root), 0
        try:
            beat, watch = heartbeat.start(rank=0, world_size=1, timeout=5, report_dir=root, board_host=None)
        except SailError as err:
            return str(err)
        heartbeat.stop(watch)
        beat.close()
        return "started"
    finally:
        dist.destroy_process_group()


@root_only
@pytest.mark.multiprocess
def test_a_record_that_cannot_be_written_stops_the_start_saying_why(full_tmpfs: Path) -> None:
    said = run_ranks(_start_with_records_in, 1, str(full_tmpfs))[0]
    assert said.startswith("sail.hang_timeout_seconds: rank 0 cannot write its progress record in "), said
    assert "No space left on device" in said and f"make room in {full_tmpfs}" in said, said
    assert [p.name for p in full_tmpfs.iterdir()] == ["filler"]  # its empty directory removed
