"""Storage faults during a save, in the user's words: which fault, where, and what was kept.

A failed save is agreed by every rank (``engine_state``): each rank's failure is reduced to a
``Failure`` (its errno, file and first line, picklable), rank 0 removes the unfinished checkpoint
and turns the failures into one ``CheckpointError`` naming the cause — a full disk with the bytes
needed and free on that filesystem, a read-only filesystem, a denied permission, a directory that
vanished, an I/O error — the path and the last good checkpoint.

Before the first step, ``probe`` checks that each rank can create and write the directory and
``check_room`` that the filesystem holds the checkpoints ``keep_last`` keeps, of the size the
state's tensors give (``estimate_bytes``).
"""

from __future__ import annotations

import errno
import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from spikingsail.checkpoint.store import LATEST
from spikingsail.errors import CheckpointError, first_line
from spikingsail.mounts import free_bytes, mount_of, nearest_existing

log = logging.getLogger(__name__)

MB = 1e6
_PROBE = ".sail-probe-"
# Below this much free space a filesystem counts as full: a writer that failed with a torch error
# (torch.save reports ENOSPC as "unexpected pos") failed because the disk filled.
FULL_BYTES = 1 << 20
# Per-parameter state tensors of torch's optimizers, for the size of a checkpoint before the first
# step (when the optimizer holds no state yet); others count as Adam's two.
_OPTIMIZER_SLOTS = {"SGD": 1, "Adagrad": 1, "RMSprop": 2, "Adadelta": 2, "Adam": 2, "AdamW": 2,
                    "Adamax": 2, "NAdam": 2, "RAdam": 2, "SparseAdam": 2}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Failure:
    """One rank's failure, as much of it as the message needs (sent between ranks)."""

    rank: int
    errno: int | None
    filename: str | None
    text: str

    @classmethod
    def of(cls, err: BaseException, rank: int) -> Failure:
        found = next((e for e in _causes(err) if isinstance(e, OSError) and e.errno), None)
        if found is not None:
            name = found.filename if isinstance(found.filename, str) else None
            return cls(rank, found.errno, name, f"{type(found).__name__}: {found}")
        return cls(rank, None, None, f"{type(err).__name__}: {first_line(err)}")


def _causes(err: BaseException) -> Iterator[BaseException]:
    """``err``, what it was raised from, and each rank's failure inside DCP's CheckpointException."""
    seen: set[int] = set()
    pending = [err]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint's exception
        if isinstance(failures, dict):
            pending += [f[0] for f in failures.values() if isinstance(f, tuple) and f]
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]


def read_only(path: Path) -> bool:
    existing = nearest_existing(path)
    return existing is not None and bool(os.statvfs(existing).f_flag & os.ST_RDONLY)


def filesystem(path: Path) -> str:
    """``MOUNTPOINT (TYPE on DEVICE)`` for the filesystem holding ``path``."""
    existing = nearest_existing(path)
    found = mount_of(existing) if existing is not None else None
    if found is None:
        return f"the filesystem of {existing or path}"
    return f"{found.point} ({found.kind} on {found.device})"


def estimate_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of one checkpoint's model and optimizer state: the whole model's tensors (sharded
    ones counted whole) and the optimizer's, or before its first step as many per-parameter slots as
    the optimizer keeps."""
    model = sum(_tensor_bytes(t) for t in module.state_dict().values() if isinstance(t, torch.Tensor))
    inner = _innermost(optimizer)
    held = sum(
        _tensor_bytes(v)
        for state in inner.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    if held:
        return model + held
    slots = _OPTIMIZER_SLOTS.get(type(inner).__name__, 2)
    if type(inner).__name__ == "SGD" and not any(g.get("momentum") for g in inner.param_groups):
        slots = 0
    parameters = sum(_tensor_bytes(p) for p in module.parameters())
    return model + slots * parameters


def _tensor_bytes(tensor: torch.Tensor) -> int:
    numel = int(getattr(tensor, "ds_numel", 0) or tensor.numel())  # DeepSpeed ZeRO-3: the whole size
    return numel * tensor.element_size()


def _innermost(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside a backend's wrapper (DeepSpeed's, ZeroRedundancyOptimizer's)."""
    seen = 0
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and seen < 4:
        optimizer = optimizer.optimizer  # type: ignore[attr-defined]
        seen += 1
    return getattr(optimizer, "optim", optimizer)


def probe(root: Path, *, create: bool, who: str) -> str | None:
    """Whether this process can create ``root`` (when ``create``) and write a file in it: None, or
    why not."""
    try:
        if create:
            root.mkdir(parents=True, exist_ok=True)
        elif not root.is_dir():
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(root))
        test = root / f"{_PROBE}{uuid.uuid4().hex}"
        try:
            with test.open("wb") as handle:
                handle.write(b"sail")
                handle.flush()
                os.fsync(handle.fileno())
        finally:
            test.unlink(missing_ok=True)
    except OSError as err:
        return describe(Failure.of(err, 0), root, who=who)
    return None


def describe(failure: Failure, root: Path, *, who: str = "") -> str:
    """One line: the cause in words, the file, and the error."""
    return f"{who}: {_cause_words(failure.errno, root)}: {failure.text}"


def _detail(failure: Failure) -> str:
    """Which rank, and its error (which names the file when the error does)."""
    return f"rank {failure.rank}: {failure.text}"


def _cause_words(code: int | None, root: Path) -> str:
    return {
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is exceeded",
        errno.EROFS: "the filesystem is read-only",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.ENOENT: f"{root} does not exist" if not root.exists() else "a file or directory vanished",
        errno.EIO: "an I/O error (the disk or the network filesystem failed)",
        errno.EFBIG: "a file is larger than this process may write (ulimit -f) or the filesystem allows",
    }.get(code or 0, "the write failed")


def save_error(
    failures: list[Failure], root: Path, tag: str, *, full: bool, needed: int, last_good: str | None
) -> CheckpointError:
    """The one message every rank raises for a failed save (rank 0 builds it after the cleanup)."""
    codes = {f.errno for f in failures}
    if full and codes == {None}:
        codes.add(errno.ENOSPC)  # no errno (torch.save's "unexpected pos"), and no room for the checkpoint
    first = min(failures, key=lambda f: (f.errno is None, f.rank))
    kept = (
        f"the last good checkpoint, {last_good}, is intact and still '{LATEST}'"
        if last_good
        else "there is no earlier checkpoint in that directory"
    )
    if not root.is_dir():
        what = f"checkpoint {tag} could not be saved: the checkpoint directory {root} vanished"
        why = (f"it was deleted or unmounted while the job ran ({_detail(first)}); the job does "
               "not make it again, since a checkpoint written where a filesystem used to be mounted "
               "would be lost with the node")  # fmt: skip
        return CheckpointError(
            what, why, f"restore {root} (remount it), or resume from a copy of its checkpoints"
        )
    if codes & {errno.ENOSPC, errno.EDQUOT}:
        free = free_bytes(root)
        quota = errno.EDQUOT in codes and errno.ENOSPC not in codes
        what = (f"checkpoint {tag} could not be saved in {root}: "
                f"{'the disk quota is exceeded' if quota else 'the disk is full'}")  # fmt: skip
        figures = f"a checkpoint takes about {needed / MB:.1f} MB"
        figures += "" if free is None else f"; {free / MB:.1f} MB are free on {filesystem(root)}"
        return CheckpointError(what, f"{figures} ({_detail(first)}; the unfinished checkpoint is removed)",
                               f"{kept}; free space there, or save to a larger filesystem "
                               "(keep_last K needs room for K+1 checkpoints)")  # fmt: skip
    fixes = {
        errno.EROFS: f"remount {filesystem(root)} read-write, or save to another filesystem",
        errno.EACCES: f"make {root} writable by user {os.getuid()} (every rank's), or save to another directory",
        errno.EPERM: f"make {root} writable by user {os.getuid()} (every rank's), or save to another directory",
        errno.EIO: "check the disk or the network filesystem (dmesg), or save to another one",
        errno.EFBIG: "raise the file size limit (ulimit -f), or save to a filesystem that allows larger files",
    }
    known = (errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG)
    code = next((c for c in known if c in codes), first.errno)
    failure = next((f for f in failures if f.errno == code), first)
    what = f"checkpoint {tag} could not be saved in {root}: {_cause_words(code, root)}"
    fix = fixes.get(code or 0, "check the checkpoint directory's filesystem")
    return CheckpointError(what, _detail(failure), f"{kept}; {fix}")


def check_room(root: Path, estimate: int, copies: int) -> CheckpointError | None:
    """None when ``root``'s filesystem holds ``copies`` more checkpoints of ``estimate`` bytes; an
    error (to raise) when it cannot hold one; else a warning is logged and None returned."""
    free = free_bytes(root)
    if free is None or estimate <= 0 or free >= copies * estimate:
        return None
    figures = (f"{free / MB:.1f} MB are free on {filesystem(root)}; a checkpoint of this model and "
               f"optimizer takes about {estimate / MB:.1f} MB")  # fmt: skip
    if free < estimate:
        return CheckpointError(
            f"the checkpoint directory {root} has no room for one checkpoint",
            figures,
            "free space there, or give --checkpoints-path a larger filesystem",
        )
    log.warning("the checkpoint directory %s has room for %d checkpoint(s), not the %d that keep_last needs "
                "while a new one is written: %s; the saves that do not fit will fail",
                root, int(free // estimate), copies, figures)  # fmt: skip
    return None
