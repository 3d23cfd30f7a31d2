"""``spikingsail.mounts``: the filesystem holding a path, as the storage checks read it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from spikingsail.mounts import mount_of


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
