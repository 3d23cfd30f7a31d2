"""Which mounted filesystem holds a path, read from ``/proc/self/mounts``."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


class Mount(NamedTuple):
    device: str
    point: str
    kind: str
    """The filesystem's type: ``ext4``, ``tmpfs``, ``nfs4``, …"""


def mount_of(path: Path) -> Mount | None:
    """The mount holding ``path`` (which must exist): the deepest mount point above it, the last
    mounted where several share one. None where ``/proc/self/mounts`` cannot be read."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    target = str(path.resolve())
    best: Mount | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        device, point, kind = fields[0], fields[1].replace("\\040", " "), fields[2]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.point)):
            best = Mount(device, point, kind)
    return best


def in_memory(path: Path) -> bool:
    """Whether ``path`` is on a filesystem held in memory (tmpfs), where a write never waits for a disk."""
    found = mount_of(path)
    return found is not None and found.kind in MEMORY_FILESYSTEMS
