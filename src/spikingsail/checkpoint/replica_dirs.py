"""Where the replica groups of a job (``sail launch --ft-replicas``) keep their checkpoints: each group in
a directory of its own under the job's (``replica-G``), and a resume from the job's directory continues
from the group that got furthest."""

from __future__ import annotations

import re
from pathlib import Path

from spikingsail.checkpoint.store import CheckpointStore


def group_checkpoints(root: str | Path, group: int) -> Path:
    """Each replica group saves under a directory of its own: the groups save at the same steps,
    and a directory is one job's (``checkpoint/lock.py``)."""
    return Path(root) / f"replica-{group}"


def newest_group_checkpoints(root: str | Path) -> Path | None:
    """The replica group directory under ``root`` whose latest checkpoint is furthest on: a group
    that starts when no other group is alive continues from there."""
    best: tuple[int, Path] | None = None
    for directory in sorted(Path(root).glob("replica-*")):
        store = CheckpointStore(directory)
        latest = store.latest()
        if latest is None:
            continue
        try:
            steps = int(store.metadata(latest)["global_steps"])
        except (OSError, ValueError, KeyError):
            steps = -1  # a damaged latest: the load falls back to the directory's older tags
        if best is None or steps > best[0]:
            best = (steps, directory)
    return best[1] if best else None


def own_group_checkpoints(path: str | Path, group: int) -> Path:
    """Where replica group ``group`` saves when asked to save to ``path``: ``path/replica-G``, or
    ``path`` itself when it is already the group's own directory (another group's becomes its own):
    every group saves the same steps, and a directory is one job's."""
    path = Path(path)
    if re.fullmatch(r"replica-\d+", path.name):
        return path.with_name(group_checkpoints("", group).name)
    return group_checkpoints(path, group)


def checkpoints_to_load(path: str | Path, tag: str | None = None) -> Path:
    """Where a load from ``path`` reads: ``path`` itself when it holds checkpoints (or a tag is named),
    else the furthest replica group directory under it — a job of replica groups saved there, and a
    resume, with or without replica groups, continues from it instead of starting over — else ``path``."""
    if tag is not None or CheckpointStore(path).has_checkpoints():
        return Path(path)
    return newest_group_checkpoints(path) or Path(path)
