"""One job per checkpoint directory: a second job is refused naming the first, a dead or
stalled job's lock is taken over, and the job's own restarts keep theirs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from spikingsail.checkpoint import lock
from spikingsail.checkpoint.lock import LOCK_NAME, STALE_SECONDS, Holder, JobLock
from spikingsail.errors import CheckpointError
from tests.cluster.harness import processes_with

SAIL = [sys.executable, "-m", "spikingsail.cli.main", "launch"]


def holder(**changes: object) -> Holder:
    return replace(Holder.this_process({}), **changes)  # type: ignore[arg-type]


def make_stale(directory: Path, *names: str) -> None:
    """As if the files had not been touched for longer than a lock stays fresh."""
    old = time.time() - STALE_SECONDS - 1
    for name in names or (LOCK_NAME,):
        os.utime(directory / name, (old, old))


@pytest.fixture
def sleeper() -> subprocess.Popen[bytes]:
    """A live process of this host that is not this one."""
    process = subprocess.Popen(["sleep", "300"])
    yield process  # type: ignore[misc]
    process.kill()
    process.wait()


def test_a_live_job_on_this_host_keeps_the_directory(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    first = JobLock(tmp_path, holder(pid=sleeper.pid, run_id="run-a"))
    first.acquire()
    with pytest.raises(CheckpointError) as refused:
        JobLock(tmp_path, holder(run_id="run-b")).acquire()
    message = str(refused.value)
    assert message.startswith(
        f"checkpoint directory {tmp_path} is in use by another job: pid {sleeper.pid} on host "
        f"{socket.gethostname()}, torchrun run run-a, started "
    )
    assert "another --checkpoints-path" in message
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == sleeper.pid  # left as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # no staged file left
    first.release()


def test_a_killed_jobs_lock_is_taken_over(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    JobLock(tmp_path, holder(pid=gone.pid, run_id="run-a")).acquire()  # never released: SIGKILL
    lock = JobLock(tmp_path, holder(run_id="run-b"))
    lock.acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["run_id"] == "run-b"
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_another_hosts_job_is_refused_until_its_heartbeat_is_stale(tmp_path: Path) -> None:
    JobLock(tmp_path, holder(host="node7", pid=1, run_id="run-a")).acquire()
    with pytest.raises(CheckpointError, match=r"in use by another job: pid 1 on host node7"):
        JobLock(tmp_path, holder(run_id="run-b")).acquire()
    make_stale(tmp_path)
    JobLock(tmp_path, holder(run_id="run-b")).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["run_id"] == "run-b"


@pytest.mark.parametrize(
    ("first", "second"),
    [({"run_id": "r1"}, {"run_id": "r1"}), ({"slurm_job_id": "77", "run_id": "r1"}, {"slurm_job_id": "77"})],
    ids=["elastic-restart", "slurm-requeue"],
)
def test_the_same_job_restarting_on_another_host_takes_its_lock(
    tmp_path: Path, first: dict[str, str], second: dict[str, str]
) -> None:
    JobLock(tmp_path, holder(host="node7", pid=1, **first)).acquire()
    JobLock(tmp_path, holder(**second)).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == socket.gethostname()


def test_a_second_engine_of_this_process_takes_the_lock_and_release_leaves_anothers_lock(
    tmp_path: Path,
) -> None:
    mine = JobLock(tmp_path, holder())
    mine.acquire()
    JobLock(tmp_path, holder()).acquire()  # this process again (a second engine): takes it over
    mine.release()
    assert (tmp_path / LOCK_NAME).exists()  # not mine any more: left alone


def test_an_unreadable_lock_is_refused_until_it_is_stale(tmp_path: Path) -> None:
    """A file that is not a lock may be a job's that is being written: only its age frees it."""
    (tmp_path / LOCK_NAME).write_text('{"host": "no')
    with pytest.raises(
        CheckpointError, match=r"may be in use: its lock .* cannot be read \(written \d+ s ago\)"
    ):
        JobLock(tmp_path, holder()).acquire()
    make_stale(tmp_path)
    JobLock(tmp_path, holder(run_id="run-b")).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["run_id"] == "run-b"


def test_a_dead_pid_in_another_pid_namespace_says_nothing(tmp_path: Path) -> None:
    """A container with the host's network has the host's name, not its pids: only the age counts."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    JobLock(tmp_path, holder(pid=gone.pid, run_id="run-a", pid_namespace="pid:[4026530000]")).acquire()
    with pytest.raises(CheckpointError, match=rf"in use by another job: pid {gone.pid} on host "):
        JobLock(tmp_path, holder(run_id="run-b")).acquire()
    make_stale(tmp_path)
    JobLock(tmp_path, holder(run_id="run-b")).acquire()


def test_a_holder_whose_lock_was_taken_over_refuses_to_save_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(lock, "HEARTBEAT_SECONDS", 0.05)
    first = JobLock(tmp_path, holder(host="node7", run_id="run-a"))
    first.acquire()
    lock.fence(tmp_path / "sub")  # still its own: saving goes on
    make_stale(tmp_path)  # as if first had been frozen for a minute
    second = JobLock(tmp_path, holder(run_id="run-b"))
    second.acquire()
    with pytest.raises(CheckpointError) as lost:
        lock.fence(tmp_path / "replica-0")  # a directory under the locked one is the lock's too
    assert str(lost.value).startswith(
        f"this job no longer holds checkpoint directory {tmp_path}: the lock now names pid {os.getpid()} "
    )
    assert "another --checkpoints-path" in str(lost.value)
    lock.fence(tmp_path.parent / "elsewhere")  # another directory: not this lock's business
    deadline = time.monotonic() + 60
    while "no longer holds" not in caplog.text:  # its refresh found out too, and said so
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first.release()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["run_id"] == "run-b"  # left alone
    second.check()
    second.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_claim_left_by_a_takeover_that_died_midway_goes_stale_too(tmp_path: Path) -> None:
    JobLock(tmp_path, holder(host="node7", run_id="run-a")).acquire()
    token = json.loads((tmp_path / LOCK_NAME).read_text())["token"]
    (tmp_path / f"{LOCK_NAME}.break-{token}").touch()
    make_stale(tmp_path, f"{LOCK_NAME}.break-{token}", LOCK_NAME)
    JobLock(tmp_path, holder(run_id="run-b")).acquire()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]


def test_an_unwritable_directory_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").touch()
    with pytest.raises(CheckpointError, match=r"cannot write the job lock .*file/\.sail-job\.lock"):
        JobLock(tmp_path / "file", holder()).acquire()


JOB = """
import sys, time, torch, spikingsail
from pathlib import Path
out = Path(sys.argv[1])
config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "checkpoint": {"path": sys.argv[2]}, "sail": {"progress_bar": False}}
engine, _ = spikingsail.initialize(model=torch.nn.Linear(2, 2), config=config)
(out / f"started{engine.rank_info.rank}").write_text("")
while not (out / "stop").exists():
    time.sleep(0.1)
engine.close()
"""


def launch(tmp_path: Path, name: str, checkpoints: Path) -> subprocess.Popen[str]:
    out = tmp_path / name
    out.mkdir()
    return subprocess.Popen([*SAIL, "-n", "2", str(tmp_path / "job.py"), str(out), str(checkpoints)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def wait_for_start(tmp_path: Path, name: str, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while not all((tmp_path / name / f"started{r}").exists() for r in (0, 1)):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.mark.multiprocess
def test_a_second_launch_into_a_live_jobs_checkpoints_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(JOB)
    checkpoints = tmp_path / "ckpt"
    first = launch(tmp_path, "first", checkpoints)
    try:
        wait_for_start(tmp_path, "first", first)
        rank0 = json.loads((checkpoints / LOCK_NAME).read_text())["pid"]
        second = launch(tmp_path, "second", checkpoints)
        _, stderr = second.communicate(timeout=120)
        assert second.returncode != 0
        reason = stderr[stderr.rindex("sail launch: ") :]
        assert "the rank's error:\ncheckpoint directory" in reason, stderr[-3000:]
        assert f"is in use by another job: pid {rank0} on host {socket.gethostname()}" in reason
        assert not list((tmp_path / "second").iterdir())  # neither rank started
        assert first.poll() is None  # the first job runs on, its lock untouched
        assert json.loads((checkpoints / LOCK_NAME).read_text())["pid"] == rank0

        # the first job is killed outright: its lock is stale, and a new launch takes it
        for pid in processes_with(str(tmp_path / "first")):
            os.kill(pid, signal.SIGKILL)
        first.wait(timeout=30)
        third = launch(tmp_path, "third", checkpoints)
        wait_for_start(tmp_path, "third", third)
        (tmp_path / "third" / "stop").touch()
        assert third.wait(timeout=60) == 0, third.communicate()
        assert not (checkpoints / LOCK_NAME).exists()  # released at the end
    finally:
        (tmp_path / "first" / "stop").touch()
        first.kill()
