"""Which mounted filesystem holds a path (read from ``/proc/self/mounts``), and its room."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple


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


def nearest_existing(path: Path) -> Path | None:
    """``path``, or its nearest ancestor that exists (None if none does)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return None


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem of ``path`` (its nearest
    existing ancestor); None when nothing of it can be read."""
    existing = nearest_existing(path)
    if existing is None:
        return None
    stat = os.statvfs(existing)
    return stat.f_bavail * stat.f_frsize
