"""Where the ranks' progress records live: in memory, so that a store never waits for a disk
(``tests/monitor/test_hang.py`` stalls a disk under a running job)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from spikingsail.errors import SailError
from spikingsail.monitor import heartbeat
from spikingsail.mounts import mount_of


def findmnt(path: Path) -> tuple[str, str, str]:
    """util-linux's answer: the mount point, type and source of the filesystem holding ``path``."""
    out = subprocess.run(
        ["findmnt", "-n", "-o", "TARGET,FSTYPE,SOURCE", "-T", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return out[0], out[1], out[2]


@pytest.mark.parametrize("path", ["/", "/tmp", "/dev/shm", "/proc/self", "/sys/fs/cgroup", "/etc/hostname"])
def test_the_mount_holding_a_path_is_the_one_findmnt_names(path: str) -> None:
    found = mount_of(Path(path))
    assert found is not None
    assert (found.point, found.kind, found.device) == findmnt(Path(path))


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
