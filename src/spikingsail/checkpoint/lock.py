"""One job per checkpoint directory.

Two jobs that save into one directory overwrite each other's checkpoints, and a resume then loads a
mix of both runs. Rank 0 of a job whose config names a checkpoint directory holds
``DIR/.sail-job.lock`` for the job's life: it names the job (host, boot id, pid namespace, pid,
torchrun run id, SLURM job id, start time) and holds a token of its own; its modification time is
refreshed every ``HEARTBEAT_SECONDS``. A second job is refused naming the first.

Each change is atomic with only ``link(2)``, ``rename(2)`` and exclusive create (local file systems,
NFS v3+, Lustre, GPFS, CephFS). Taking a free lock: the holder's file, written in full under a name
of its own, is hard linked to the lock's name, which fails if a lock is there; whichever token the
lock then holds has it (on NFS a retried link may report failure after succeeding). Taking over a
stale lock: under an exclusive claim named after that lock's token, one process at a time checks
that the lock still holds that token, renames it aside, checks it moved that one (a live lock moved
by a claimant that stalled past its claim's staleness is linked back), then links its own.
Refreshing touches the holder's own file through a descriptor it keeps open: never another's lock.

A lock is the job's own, or stale, and then taken over, when it names this job (the same torchrun
run id: an elastic restart; the same SLURM job id: a requeued job); when its process is gone where
this process can tell (the same host, boot and pid namespace, and no such pid, or this very
process: a second engine of one script; containers with the host's network share its name, not its
pids); or when it was not refreshed for ``STALE_SECONDS`` (a lost node, a frozen process), measured
against a file this process has just touched there: both times from the file system's clock.

The holder checks that the lock still holds its token at every refresh and before every save
(``fence``): a job whose lock was taken over logs it at once and refuses every later save there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from spikingsail.environments import slurm
from spikingsail.errors import CheckpointError

log = logging.getLogger(__name__)

LOCK_NAME = ".sail-job.lock"
HEARTBEAT_SECONDS = 10.0
STALE_SECONDS = 60.0
_ATTEMPTS = 8  # a lock that changes hands this often while this process tries is busy, not stale
_TOKEN = re.compile(r"[0-9a-f]{32}")
_held: weakref.WeakSet[JobLock] = weakref.WeakSet()


@dataclass(kw_only=True, slots=True, frozen=True)
class Holder:
    host: str
    pid: int
    run_id: str
    slurm_job_id: str
    started: str
    token: str
    boot_id: str = ""  # empty in locks of earlier versions: their pid is not trusted
    pid_namespace: str = ""

    @classmethod
    def this_process(cls, env: Mapping[str, str] | None = None) -> Holder:
        env = os.environ if env is None else env
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            run_id=env.get("TORCHELASTIC_RUN_ID", ""),
            slurm_job_id=slurm.job_id(env),
            started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            token=uuid.uuid4().hex,
            boot_id=_from_proc(lambda: Path("/proc/sys/kernel/random/boot_id").read_text()),
            pid_namespace=_from_proc(lambda: os.readlink("/proc/self/ns/pid")),
        )

    def same_job(self, other: Holder) -> bool:
        return bool(
            (self.run_id and self.run_id == other.run_id)
            or (self.slurm_job_id and self.slurm_job_id == other.slurm_job_id)
        )

    def sees_pids_of(self, other: Holder) -> bool:
        """Whether ``other.pid`` names a process this one can look up: one host, one boot of it, one
        pid namespace (a host name alone is shared by containers with the host's network)."""
        return bool(self.boot_id and self.pid_namespace) and self._place() == other._place()

    def _place(self) -> tuple[str, str, str]:
        return self.host, self.boot_id, self.pid_namespace

    def describe(self) -> str:
        job = f", torchrun run {self.run_id}" if self.run_id else ""
        job += f", SLURM job {self.slurm_job_id}" if self.slurm_job_id else ""
        return f"pid {self.pid} on host {self.host}{job}, started {self.started}"


@dataclass(frozen=True, slots=True)
class _Seen:
    """A lock file as read through one open: who it names, and its modification time."""

    holder: Holder | None  # None: unreadable (a foreign or damaged file)
    identity: str  # the token; for an unreadable file, its inode
    mtime: float


class JobLock:
    """Rank 0's hold on a checkpoint directory (``acquire``), refreshed by a daemon thread."""

    def __init__(self, directory: str | Path, holder: Holder | None = None) -> None:
        self.path = Path(directory) / LOCK_NAME
        self.holder = holder or Holder.this_process()
        # read now, not at import: tests (and a script, before its engine starts) may shorten them
        self.heartbeat_seconds, self.stale_seconds = HEARTBEAT_SECONDS, STALE_SECONDS
        self._fd: int | None = None  # the holder's own file, for refreshing it and reading the clock
        self._lost: CheckpointError | None = None
        self._verifying = threading.Lock()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lock, or raise CheckpointError naming the job that holds it."""
        staged = self.path.with_name(f"{LOCK_NAME}.{self.holder.token}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = _write_new(staged, json.dumps(asdict(self.holder)) + "\n")
            try:
                self._take(staged)
            finally:
                staged.unlink(missing_ok=True)
        except OSError as err:
            self._close()
            raise CheckpointError(
                f"cannot write the job lock {self.path}: {err.strerror}",
                "rank 0 marks the checkpoint directory as in use, so that a second job cannot save there; "
                "the lock needs hard links, which every local and cluster file system has (some FUSE "
                "mounts of object stores do not)",
                "make the checkpoint directory writable, or choose another --checkpoints-path",
            ) from None
        except BaseException:
            self._close()
            raise
        _held.add(self)
        self._beat = threading.Thread(target=self._heartbeat, name="sail-job-lock", daemon=True)
        self._beat.start()

    def check(self, directory: str | Path | None = None) -> None:
        """Before a save into ``directory`` (default: the locked one; others are not this lock's):
        raise CheckpointError if this job no longer holds the lock."""
        if directory is not None and not _within(Path(directory), self.path.parent):
            return
        with self._verifying:
            if self._lost is None and self._fd is not None:
                try:
                    self._verify()
                except OSError as err:
                    raise CheckpointError(
                        f"cannot read the job lock {self.path} before saving: {err.strerror}",
                        "a save checks that this job still holds the checkpoint directory",
                        "check the checkpoint directory's file system",
                    ) from None
            if self._lost is not None:
                raise self._lost

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
            self._beat = None
        _held.discard(self)
        if self._fd is not None and self._lost is None:
            with contextlib.suppress(OSError):
                self._remove_own()
        self._close()

    # -- taking ----------------------------------------------------------------------------------

    def _take(self, staged: Path) -> None:
        for _ in range(_ATTEMPTS):
            with contextlib.suppress(FileExistsError):
                os.link(staged, self.path)
            seen = _look(self.path)
            if seen is None:  # released meanwhile
                continue
            if seen.identity == self.holder.token:
                return
            if not self._may_take(seen):
                raise self._refusal(seen)
            self._break(seen)
        raise CheckpointError(
            f"could not take the job lock {self.path}: it changed hands {_ATTEMPTS} times meanwhile",
            "other jobs are starting on this checkpoint directory at the same moment",
            "run one job per checkpoint directory: give each its own --checkpoints-path",
        )

    def _may_take(self, seen: _Seen) -> bool:
        other = seen.holder
        if other is not None:
            if other.same_job(self.holder):
                return True
            if self.holder.sees_pids_of(other) and (other.pid == self.holder.pid or not _alive(other.pid)):
                return True
        return self._age(seen) > self.stale_seconds

    def _break(self, seen: _Seen) -> None:
        """Move the lock ``seen`` aside, if it is still there, holding the claim on it."""
        claim = self.path.with_name(f"{LOCK_NAME}.break-{seen.identity}")
        if not self._claim(claim, seen):
            return
        try:
            now = _look(self.path)
            if now is None or now.identity != seen.identity:
                return  # broken by a claimant whose claim this one replaced as stale
            aside = self.path.with_name(f"{LOCK_NAME}.aside-{self.holder.token}")
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                return
            moved = _look(aside)
            if moved is not None and moved.identity != seen.identity:
                log.warning("job lock %s: moved a live lock aside; putting it back", self.path)
                with contextlib.suppress(FileExistsError):
                    os.link(aside, self.path)
            aside.unlink(missing_ok=True)
        finally:
            claim.unlink(missing_ok=True)

    def _claim(self, claim: Path, seen: _Seen) -> bool:
        """Wait for the claim on lock ``seen``; False once another claimant has broken it."""
        while not _create(claim):
            other = _look(claim)
            if other is not None and self._age(other) > self.stale_seconds:
                claim.unlink(missing_ok=True)  # its claimant died between two steps of a takeover
                continue
            now = _look(self.path)
            if now is None or now.identity != seen.identity:
                return False
            time.sleep(0.01)
        return True

    def _age(self, seen: _Seen) -> float:
        """Seconds since ``seen`` was refreshed, by the file system's clock: the time it gives this
        process's own file, touched now."""
        assert self._fd is not None  # set before anything is read
        os.utime(self._fd)
        return os.fstat(self._fd).st_mtime - seen.mtime

    def _refusal(self, seen: _Seen) -> CheckpointError:
        ago = f"{self._age(seen):.0f} s ago"
        after = f"the lock is taken over {self.stale_seconds:.0f} s after its last refresh"
        if seen.holder is None:
            return CheckpointError(
                f"checkpoint directory {self.path.parent} may be in use: its lock {self.path} cannot be "
                f"read (written {ago})",
                "a job may be writing there; two jobs saving into one directory overwrite each other's "
                "checkpoints",
                f"if no job uses this directory, remove {self.path}; otherwise {after}",
            )
        return CheckpointError(
            f"checkpoint directory {self.path.parent} is in use by another job: {seen.holder.describe()} "
            f"(its lock {self.path} was refreshed {ago})",
            "two jobs saving into one directory overwrite each other's checkpoints, and a resume would "
            "load a mix of both",
            f"wait for that job to end or stop it, or give this run another --checkpoints-path; if that "
            f"job is gone, {after}",
        )

    # -- holding ---------------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                assert self._fd is not None  # closed only after this thread ends
                os.utime(self._fd)  # this job's own file, wherever it is now
                self.check()
            except CheckpointError:  # logged where it was found
                return
            except OSError as err:  # a file system hiccup: the next refresh tries again
                log.warning("job lock %s: refresh failed: %s", self.path, err)

    def _verify(self) -> None:
        seen = _look(self.path)
        if seen is not None and seen.identity == self.holder.token:
            return
        if seen is None and not self.path.parent.exists():
            return  # the whole directory is gone: the save reports that (and does not make it again)
        now = "the lock was removed"
        if seen is not None:
            now = f"the lock now names {seen.holder.describe() if seen.holder else 'an unreadable file'}"
        self._lost = CheckpointError(
            f"this job no longer holds checkpoint directory {self.path.parent}: {now} ({self.path}); "
            "it saves nothing more there",
            f"this job's lock was not refreshed for over {self.stale_seconds:.0f} s (the process was "
            "stopped or starved, or the file system stalled), so another job took the directory over "
            "as stale, or the lock was removed; saving now would overwrite the other job's checkpoints",
            "stop this job; to continue it, resume from its last checkpoint in another "
            "--checkpoints-path (copy it there), or in this one once the other job has ended",
        )
        log.error("%s", self._lost)  # at once, whether a refresh or a save found it

    def _remove_own(self) -> None:
        claim = self.path.with_name(f"{LOCK_NAME}.break-{self.holder.token}")
        if not _create(claim):
            return  # another job is taking it over: it is theirs now
        try:
            seen = _look(self.path)
            if seen is not None and seen.identity == self.holder.token:
                self.path.unlink()
        finally:
            claim.unlink(missing_ok=True)

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def fence(directory: str | Path) -> None:
    """Raise CheckpointError if a job lock this process took on ``directory`` (or a directory above
    it) has been taken over: call before saving into ``directory``."""
    for lock in list(_held):
        lock.check(directory)


def _write_new(path: Path, text: str) -> int:
    """A new file holding ``text`` in full (on disk before it is linked anywhere); a read-only
    descriptor of it. Its owner refreshes it through that (futimens needs no write access from the
    owner), and a file open only for reading does not keep its file system from being remounted
    read-only (the save then reports the read-only file system)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return os.open(path, os.O_RDONLY)


def _look(path: Path) -> _Seen | None:
    """The lock file at ``path`` (None when there is none), contents and times from one open: on
    NFS an open revalidates a file's attributes, where a bare stat may answer from a cache."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        stat = os.fstat(fd)
        raw = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    holder = _parse(raw)
    identity = holder.token if holder is not None else f"inode-{stat.st_dev}-{stat.st_ino}"
    return _Seen(holder, identity, stat.st_mtime)


def _parse(raw: bytes) -> Holder | None:
    try:
        data = json.loads(raw)
        known = {f.name for f in fields(Holder)}
        holder = Holder(**{k: v for k, v in data.items() if k in known})
    except (ValueError, TypeError, AttributeError):
        return None
    texts = [getattr(holder, f.name) for f in fields(Holder) if f.name != "pid"]
    if not isinstance(holder.pid, int) or not all(isinstance(t, str) for t in texts):
        return None
    return holder if _TOKEN.fullmatch(holder.token) else None  # the token becomes a file name


def _within(directory: Path, root: Path) -> bool:
    return directory.resolve().is_relative_to(root.resolve())


def _from_proc(read: Callable[[], str]) -> str:
    """What ``read`` finds in /proc; "" where there is none (not Linux)."""
    try:
        return read().strip()
    except OSError:
        return ""


def _create(path: Path) -> bool:
    """Whether this call made the (empty) file ``path``: False if it was there."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


def _alive(pid: int) -> bool:
    if pid <= 0:  # os.kill would address a process group
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
