"""A tmpfs mounted for one test (root, as in CI): a filesystem of a size the test chooses."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's ``size=``: ``16m``, ``64k``) at ``mount``, which is made here;
    unmounted whatever the test did."""
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
