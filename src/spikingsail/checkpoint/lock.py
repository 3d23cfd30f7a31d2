"""One job per checkpoint directory.

Two jobs that save into one directory overwrite each other's checkpoints, and a resume then loads a
mix of both runs. Rank 0 of a job whose config names a checkpoint directory holds
``DIR/.sail-job.lock`` for the job's life: it names the host, pid, job and start time, and its
modification time is refreshed every ``HEARTBEAT_SECONDS``. A second job is refused with the first
job's host and pid.

A lock is the job's own, or stale, and then taken over, when

- it names this job: the same torchrun run id (an elastic restart) or the same SLURM job id (a
  requeued job);
- its process is gone: same host, and no process with its pid (a job killed with SIGKILL), or this
  very process (a second engine of one script);
- its heartbeat stopped: not refreshed for ``STALE_SECONDS`` (a lost node, a frozen process).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from spikingsail.environments import slurm
from spikingsail.errors import CheckpointError

LOCK_NAME = ".sail-job.lock"
HEARTBEAT_SECONDS = 10.0
STALE_SECONDS = 60.0


@dataclass(kw_only=True, slots=True, frozen=True)
class Holder:
    host: str
    pid: int
    run_id: str
    slurm_job_id: str
    started: str
    token: str

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
        )

    def same_job(self, other: Holder) -> bool:
        return bool(
            (self.run_id and self.run_id == other.run_id)
            or (self.slurm_job_id and self.slurm_job_id == other.slurm_job_id)
        )

    def describe(self) -> str:
        job = f", torchrun run {self.run_id}" if self.run_id else ""
        job += f", SLURM job {self.slurm_job_id}" if self.slurm_job_id else ""
        return f"pid {self.pid} on host {self.host}{job}, started {self.started}"


class JobLock:
    """Rank 0's hold on a checkpoint directory (``acquire``), refreshed by a daemon thread."""

    def __init__(self, directory: str | Path, holder: Holder | None = None) -> None:
        self.path = Path(directory) / LOCK_NAME
        self.holder = holder or Holder.this_process()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lock, or raise CheckpointError naming the job that holds it."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            staged = self.path.with_name(f"{LOCK_NAME}.{self.holder.token}")
            staged.write_text(json.dumps(asdict(self.holder)) + "\n")
            try:
                os.link(staged, self.path)  # atomic, and fails if a lock is there (also on NFS)
            except FileExistsError:
                other = _read(self.path)
                if other is not None and not self._may_take(other):
                    raise self._refusal(other) from None
                os.replace(staged, self.path)  # stale, or ours: take it over
            finally:
                staged.unlink(missing_ok=True)
        except OSError as err:
            raise CheckpointError(
                f"cannot write the job lock {self.path}: {err.strerror}",
                "rank 0 marks the checkpoint directory as in use, so that a second job cannot save there",
                "make the checkpoint directory writable, or choose another --checkpoints-path",
            ) from None
        now = _read(self.path)
        if now != self.holder:  # another job took it over at the same moment
            if now is not None:
                raise self._refusal(now)
            raise CheckpointError(
                f"the job lock {self.path} vanished while this job took it",
                "another job or a person removed it at the same moment",
                "check that no other job uses this checkpoint directory, then start again",
            )
        self._beat = threading.Thread(target=self._heartbeat, name="sail-job-lock", daemon=True)
        self._beat.start()

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
            self._beat = None
        if _read(self.path) == self.holder:
            with contextlib.suppress(OSError):
                self.path.unlink()

    def _may_take(self, other: Holder) -> bool:
        if other.same_job(self.holder) or other == self.holder:
            return True
        if other.host == self.holder.host and (other.pid == self.holder.pid or not _alive(other.pid)):
            return True
        return self._age() > STALE_SECONDS

    def _age(self) -> float:
        try:
            return time.time() - self.path.stat().st_mtime
        except OSError:
            return float("inf")

    def _refusal(self, other: Holder) -> CheckpointError:
        return CheckpointError(
            f"checkpoint directory {self.path.parent} is in use by another job: {other.describe()} "
            f"(its lock {self.path} was refreshed {self._age():.0f} s ago)",
            "two jobs saving into one directory overwrite each other's checkpoints, and a resume would "
            "load a mix of both",
            "wait for that job to end or stop it, or give this run another --checkpoints-path; if that "
            f"job is gone, the lock is taken over {STALE_SECONDS:.0f} s after its last refresh",
        )

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            with contextlib.suppress(OSError):
                os.utime(self.path)


def _read(path: Path) -> Holder | None:
    """The holder a lock file names; None when it is gone or unreadable (a torn or foreign file,
    which is then taken over)."""
    try:
        return Holder(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
