"""Checkpoint directories that a crash at any instant cannot leave half-written.

A checkpoint ``ROOT/TAG/`` is written into ``ROOT/.staging-TAG/``, every file fsynced, a
``manifest.json`` with each file's size and SHA-256 written last, then the directory is renamed
into place and ``ROOT/latest`` (the tag) replaced atomically. A crash before the rename leaves the
previous checkpoint and ``latest`` untouched; staging directories are cleared on the next save.
Saving a tag that exists moves the old directory aside (``ROOT/.replaced-TAG/``) before the new one is
renamed into place, and deletes it after; a crash in between leaves the old one aside, and the next
save or load puts it back. Loading verifies the manifest; asking for "latest" falls back to the newest checkpoint that
verifies, and says so.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from spikingsail.errors import CheckpointError, first_line

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
_STAGING = ".staging-"
_REPLACED = ".replaced-"


class CheckpointStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    # -- writing ---------------------------------------------------------------------------------

    def staging(self, tag: str) -> Path:
        return self.root / f"{_STAGING}{tag}"

    def prepare(self, tag: str, *, create: bool = True) -> Path:
        """A fresh, empty staging directory for ``tag`` (rank 0 only). Without ``create`` a missing
        root is an error (FileNotFoundError): the directory existed and vanished."""
        _check_tag(tag)
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        elif not self.root.is_dir():
            raise FileNotFoundError(errno.ENOENT, "the checkpoint directory vanished", str(self.root))
        self.recover()
        for stale in self.root.glob(f"{_STAGING}*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = self.staging(tag)
        staging.mkdir()
        return staging

    def commit(
        self, tag: str, metadata: dict[str, Any], sealed: dict[str, dict[str, Any]] | None = None
    ) -> Path:
        """Seal the staging directory: manifest, fsync, rename into place, move ``latest``.

        ``sealed``: manifest entries of files already fsynced and hashed (by the ranks that wrote
        them, see ``seal``); the remaining files are sealed here.
        """
        staging = self.staging(tag)
        files = dict(sealed or {})
        rest = [
            p for p in sorted(staging.rglob("*")) if p.is_file() and str(p.relative_to(staging)) not in files
        ]
        files.update(seal(staging, rest))
        manifest = {"format": 1, "tag": tag, "created": time.time(), "files": dict(sorted(files.items())),
                    **metadata}  # fmt: skip
        _write_durably(staging / MANIFEST, json.dumps(manifest, indent=1))
        for directory in sorted({p.parent for p in staging.rglob("*")} | {staging}):
            _fsync_dir(directory)
        final = self.root / tag
        aside = self.root / f"{_REPLACED}{tag}"
        if final.exists():
            # Saving the same tag again: the old checkpoint stays whole until the new one is in place.
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
            _fsync_dir(self.root)
        try:
            os.replace(staging, final)
            _fsync_dir(self.root)
            _write_durably(self.root / LATEST, tag)
        except BaseException:
            self._undo_commit(tag)
            raise
        shutil.rmtree(aside, ignore_errors=True)
        return final

    def _undo_commit(self, tag: str) -> None:
        """A commit that failed once the new checkpoint was in place (``latest`` could not be
        written): take the new one out and put back the one it replaced, so that ``latest`` and the
        older checkpoints are as before the save."""
        final, aside = self.root / tag, self.root / f"{_REPLACED}{tag}"
        with contextlib.suppress(OSError):
            (self.root / f".{LATEST}.tmp").unlink(missing_ok=True)
            if final.exists():
                shutil.rmtree(final, ignore_errors=True)
            if aside.exists():
                os.replace(aside, final)

    def abandon(self, tag: str) -> None:
        """Remove what a failed save of ``tag`` left: its staging directory (and the temporary
        ``latest``), so that the space it took is free again. Never touches a finished checkpoint."""
        shutil.rmtree(self.staging(tag), ignore_errors=True)
        with contextlib.suppress(OSError):
            (self.root / f".{LATEST}.tmp").unlink(missing_ok=True)

    def size(self, tag: str) -> int | None:
        """The bytes of a finished checkpoint, from its manifest (None when unreadable)."""
        try:
            files = self.metadata(tag)["files"]
        except CheckpointError:
            return None
        return sum(int(entry["size"]) for entry in files.values())

    def recover(self) -> None:
        """Put back a checkpoint moved aside by a re-save that died before its replacement was in
        place; drop one whose replacement is complete."""
        if not self.root.is_dir():
            return
        for aside in self.root.glob(f"{_REPLACED}*"):
            final = self.root / aside.name.removeprefix(_REPLACED)
            if final.exists():
                shutil.rmtree(aside, ignore_errors=True)
            else:
                log.warning("a re-save of %s did not finish: restoring the previous %s", final.name, final)
                os.replace(aside, final)
                _fsync_dir(self.root)

    def prune(self, keep_last: int) -> None:
        """Delete all but the newest ``keep_last`` checkpoints (after a new one is complete)."""
        if keep_last <= 0:
            return
        for tag in self.tags()[:-keep_last]:
            shutil.rmtree(self.root / tag, ignore_errors=True)

    # -- reading ---------------------------------------------------------------------------------

    def tags(self) -> list[str]:
        """Complete checkpoints (with a manifest), oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")]
        return [p.name for p in sorted(found, key=_manifest_time) if (p / MANIFEST).is_file()]

    def latest(self) -> str | None:
        """The tag ``latest`` names (as written; bytes that are not UTF-8 replaced, so that a damaged
        pointer names no tag and a resume falls back), or None without a pointer."""
        pointer = self.root / LATEST
        try:
            return pointer.read_bytes().decode("utf-8", "replace").strip() if pointer.is_file() else None
        except OSError:
            return None

    def verify(self, tag: str) -> Path:
        _check_tag(tag)
        path = self.root / tag
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointError(
                f"checkpoint {path} is incomplete: no {MANIFEST}",
                "the manifest is written last, so the save did not finish",
                "resume from another tag, or from 'latest'",
            )
        manifest = read_manifest(manifest_path)
        for name, expected in manifest["files"].items():
            file = path / name
            if not file.is_file():
                raise CheckpointError(
                    f"{file} is missing", f"{MANIFEST} lists it", "resume from another checkpoint"
                )
            size = file.stat().st_size
            if size != expected["size"]:
                raise CheckpointError(
                    f"{file} is truncated or overwritten: {size} bytes, the manifest says {expected['size']}",
                    fix="resume from another checkpoint",
                )
            if _sha256(file) != expected["sha256"]:
                raise CheckpointError(
                    f"{file} is corrupt: its SHA-256 differs from the manifest's",
                    fix="resume from another checkpoint",
                )
        return path

    def resolve(self, tag: str | None, check: Callable[[Path], object] | None = None) -> str:
        """The tag to load: ``tag`` verified, or the newest checkpoint that verifies. ``check``: what
        else a checkpoint must pass to be loaded (it raises ``CheckpointError``), as verify does."""
        self.recover()

        def usable(name: str) -> None:
            path = self.verify(name)
            if check is not None:
                check(path)

        if tag is not None:
            usable(tag)
            return tag
        latest = self.latest()
        candidates = self.tags()
        problems = []
        if latest in candidates:
            candidates.remove(latest)
            candidates.append(latest)  # try the pointer first, then the newest others
        elif latest is not None:
            problems.append(f"'{LATEST}' names {latest}, which is missing or has no {MANIFEST}")
        for candidate in reversed(candidates):
            try:
                usable(candidate)
            except CheckpointError as err:
                problems.append(first_line(err))
                continue
            if problems:
                log.warning(
                    "checkpoint fallback: %s; resuming from %s instead", "; ".join(problems), candidate
                )
            return candidate
        named = f" ('{LATEST}' names {latest})" if latest else ""
        raise CheckpointError(
            f"no loadable checkpoint in {self.root}{named}",
            "; ".join(problems) or "the directory holds no complete checkpoint",
            "check --checkpoints-path, or start without --resume",
        )

    def has_checkpoints(self) -> bool:
        """Whether a resume should load from here: a complete checkpoint, or a ``latest`` pointer
        (which promises one, so that losing every checkpoint fails loudly instead of starting over).
        Reads only: every rank asks, and rank 0's ``resolve`` does any recovery."""
        moved_aside = self.root.is_dir() and any(self.root.glob(f"{_REPLACED}*"))
        return bool(self.tags()) or self.latest() is not None or moved_aside

    def metadata(self, tag: str) -> dict[str, Any]:
        """The manifest of ``tag``, checked (``read_manifest``); ``ManifestError`` for a tag that
        names no checkpoint directory (a damaged ``latest``) too."""
        try:
            _check_tag(tag)
        except CheckpointError as err:
            raise ManifestError(err.what, err.why, err.fix) from None
        return read_manifest(self.root / tag / MANIFEST)


class ManifestError(CheckpointError, ValueError):
    """A manifest that is not one SpikingSail wrote: unreadable, not JSON, or of another shape. (Also
    a ValueError, as reading a damaged manifest raised before its shape was checked.)"""


_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_COUNT = 2**63 - 1  # sizes, steps and world sizes are int64 wherever they are used
_MAX_TIME = 1e11  # seconds since 1970: year 5138, within what datetime shows
_OPTIONAL_COUNTS = {"global_steps": 0, "micro_steps": 0, "world_size": 1}  # key: its least value


def read_manifest(path: Path) -> dict[str, Any]:
    """A checkpoint's ``manifest.json``, read and checked in one place: every shape that is not the
    one ``commit`` writes raises ``ManifestError`` (what, why, fix), so that the callers (verify,
    resolve's fallback, ``sail checkpoint``) can use what it returns without further checks."""
    try:
        text = path.read_bytes().decode("utf-8")
        data = json.loads(text)
    except OSError as err:
        raise ManifestError(f"cannot read {path}", first_line(err), _MANIFEST_FIX) from None
    except UnicodeDecodeError as err:
        raise ManifestError(f"{path} is corrupt", f"byte {err.start} is not UTF-8", _MANIFEST_FIX) from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError, an integer of too many digits
        raise ManifestError(f"{path} is corrupt", f"not JSON: {first_line(err)}", _MANIFEST_FIX) from None
    problem = _manifest_problem(data)
    if problem:
        raise ManifestError(f"{path} is corrupt", problem, _MANIFEST_FIX)
    return dict(data)


_MANIFEST_FIX = (
    "use another checkpoint: a resume or an export without a tag falls back to the newest good one"
)


def _manifest_problem(data: Any) -> str | None:
    """What is wrong with a decoded manifest (None: nothing)."""
    if not isinstance(data, dict):
        return f"it holds a JSON {_kind(data)}, not an object"
    files = data.get("files")
    if not isinstance(files, dict):
        return "it has no 'files' object" if files is None else f"'files' is a JSON {_kind(files)}"
    for name, entry in files.items():
        problem = _file_entry_problem(name, entry)
        if problem:
            return f"'files' entry {name!r}: {problem}"
    created = data.get("created", 0.0)
    if not _is_number(created) or not 0 <= created < _MAX_TIME:
        return f"'created' is {created!r}, not a time in seconds since 1970"
    for key, least in _OPTIONAL_COUNTS.items():
        value = data.get(key, least)
        if not _is_count(value, least):
            return f"{key!r} is {value!r}, not an integer ≥ {least}"
    return None


def _file_entry_problem(name: str, entry: Any) -> str | None:
    parts = name.split("/")
    if not name or "\x00" in name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return "not a relative path inside the checkpoint"
    if name == MANIFEST:
        return "the manifest cannot list itself"
    if not isinstance(entry, dict):
        return f"a JSON {_kind(entry)}, not an object with 'size' and 'sha256'"
    if not _is_count(entry.get("size"), 0):
        return f"'size' is {entry.get('size')!r}, not a number of bytes"
    if not isinstance(entry.get("sha256"), str) or not _SHA256.fullmatch(entry["sha256"]):
        return f"'sha256' is {entry.get('sha256')!r}, not 64 lower-case hex digits"
    return None


def _is_count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value <= _MAX_COUNT


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return abs(value) <= _MAX_COUNT if isinstance(value, int) else math.isfinite(value)


def _kind(value: Any) -> str:
    """A decoded JSON value's type, as JSON names it."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return names.get(type(value), "null")


def seal(root: Path, paths: list[Path]) -> dict[str, dict[str, Any]]:
    """fsync and hash files (manifest entries keyed by path relative to ``root``).

    Both release the GIL, so threads overlap the disk flush with the hashing and spread the
    hashing of several files over the cores.
    """
    if not paths:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, 2 * len(paths)), thread_name_prefix="sail-seal") as pool:
        synced = [pool.submit(_fsync_file, p) for p in paths]
        digests = [pool.submit(_sha256, p) for p in paths]
        for done in synced:
            done.result()
        return {str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": d.result()}
                for p, d in zip(paths, digests, strict=True)}  # fmt: skip


def _check_tag(tag: str) -> None:
    if not tag or "/" in tag or "\x00" in tag or tag.startswith(".") or tag == LATEST:
        raise CheckpointError(
            f"checkpoint tag {tag!r} is not a plain directory name", fix="use e.g. global_step100"
        )


def _manifest_time(path: Path) -> float:
    try:
        return float(read_manifest(path / MANIFEST).get("created", path.stat().st_mtime))
    except CheckpointError:  # a damaged manifest: the directory's own time orders it
        return path.stat().st_mtime


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    replace_durably(temporary, path)


def replace_durably(temporary: Path, path: Path) -> None:
    """Put a finished ``temporary`` file in place as ``path``: fsynced, renamed, the rename fsynced;
    a crash leaves the old ``path`` or the new one, never a part."""
    _fsync_file(temporary)
    os.replace(temporary, path)
    _fsync_dir(path.parent)
