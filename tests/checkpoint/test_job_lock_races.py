"""One job per checkpoint directory, under real contention: many processes taking one lock at the
same moment, a holder frozen until its lock goes stale, and a holder in another pid namespace."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from spikingsail.checkpoint.lock import LOCK_NAME, Holder, JobLock
from spikingsail.errors import CheckpointError

ACQUIRERS = 16
ROUNDS = 40
# the calls that read or change the lock: before each, an acquirer waits a moment of its own (up to
# 3 ms, seeded), so that the processes' steps interleave in ever other orders (without it, on two
# cores, one process usually finishes before the next starts)
FILE_CALLS = {"link", "rename", "replace", "unlink", "open", "utime", "stat", "fstat", "read"}


def _jitter(rng: random.Random) -> Callable[[Any, str, Any], None]:
    def before_call(frame: Any, event: str, function: Any) -> None:
        if (
            event == "c_call"
            and getattr(function, "__module__", None) == "posix"
            and function.__name__ in FILE_CALLS
        ):
            time.sleep(rng.uniform(0, 0.003))

    return before_call


def _acquirer(index: int, root: str, barrier: Any, won: Any) -> None:
    """One of ACQUIRERS processes: each round, try the round's directory at the same moment as the
    others; a winner holds the lock until every one has tried."""
    for round_ in range(ROUNDS):
        barrier.wait()
        mine = JobLock(Path(root) / str(round_), replace(Holder.this_process({}), run_id=f"job-{index}"))
        sys.setprofile(_jitter(random.Random(index * ROUNDS + round_)))
        try:
            mine.acquire()
            won[index] = 1
        except CheckpointError:
            won[index] = 0
        except Exception:  # anything but a clear refusal fails the round
            won[index] = -1
        finally:
            sys.setprofile(None)
        barrier.wait()  # every one has tried: the parent looks
        barrier.wait()
        if won[index] == 1:
            mine.release()


def write_lock(directory: Path, holder: Holder, *, age: float) -> None:
    """The lock a job left, last refreshed ``age`` seconds ago."""
    (directory / LOCK_NAME).write_text(json.dumps(asdict(holder)) + "\n")
    os.utime(directory / LOCK_NAME, (time.time() - age,) * 2)


@pytest.mark.parametrize("before", ["free", "stale", "dead-holder"])
def test_of_many_processes_taking_one_lock_at_once_exactly_one_gets_it(tmp_path: Path, before: str) -> None:
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(ACQUIRERS + 1, timeout=120)
    won = context.Array("i", ACQUIRERS)
    workers = [
        context.Process(target=_acquirer, args=(i, str(tmp_path), barrier, won)) for i in range(ACQUIRERS)
    ]
    for worker in workers:
        worker.start()
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        for round_ in range(ROUNDS):
            directory = tmp_path / str(round_)
            directory.mkdir()
            if before == "stale":  # another node's job that stopped refreshing an hour ago
                write_lock(directory, replace(Holder.this_process({}), host="node7", run_id="gone"), age=3600)
            elif before == "dead-holder":  # a job of this host killed a moment ago
                write_lock(directory, replace(Holder.this_process({}), pid=dead.pid, run_id="gone"), age=0)
            barrier.wait()
            barrier.wait()
            outcomes = [won[i] for i in range(ACQUIRERS)]
            winners = [i for i, outcome in enumerate(outcomes) if outcome == 1]
            assert -1 not in outcomes, f"round {round_}: an acquirer failed without a clear refusal"
            assert len(winners) == 1, f"round {round_}: {len(winners)} processes took the lock"
            assert json.loads((directory / LOCK_NAME).read_text())["run_id"] == f"job-{winners[0]}"
            barrier.wait()
        for worker in workers:
            worker.join(timeout=60)
            assert worker.exitcode == 0
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()


def _try(lock: JobLock) -> CheckpointError | None:
    try:
        lock.acquire()
    except CheckpointError as refused:
        return refused
    return None


HOLDER = """
import sys, time, torch, spikingsail
from pathlib import Path
from spikingsail.checkpoint import lock
from spikingsail.errors import CheckpointError
lock.HEARTBEAT_SECONDS, lock.STALE_SECONDS = 0.1, 2.0
out, checkpoints = Path(sys.argv[1]), sys.argv[2]
config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "checkpoint": {"path": checkpoints}, "sail": {"progress_bar": False}}
engine, _ = spikingsail.initialize(model=torch.nn.Linear(2, 2), config=config)
engine.save_checkpoint(checkpoints, tag="before")
(out / "ready").write_text("")
while not (out / "go").exists():
    time.sleep(0.05)
try:
    engine.save_checkpoint(checkpoints, tag="after")
except CheckpointError as err:
    (out / "refused").write_text(str(err))
engine.close()
"""


def test_a_frozen_holder_loses_its_lock_and_refuses_to_save_when_it_wakes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "holder.py").write_text(HOLDER)
    checkpoints = tmp_path / "ckpt"
    process = subprocess.Popen([sys.executable, "holder.py", str(tmp_path), str(checkpoints)], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(signal.SIGSTOP)
        monkeypatch.setattr("spikingsail.checkpoint.lock.STALE_SECONDS", 2.0)
        taker = JobLock(checkpoints, replace(Holder.this_process({}), run_id="taker"))
        while (refused := _try(taker)) is not None:  # while the frozen holder's last refresh is recent
            assert "is in use by another job" in str(refused)
            assert time.monotonic() < deadline
            time.sleep(0.2)
        (tmp_path / "go").touch()
        process.send_signal(signal.SIGCONT)
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr[-3000:]
        refusal = (tmp_path / "refused").read_text() if (tmp_path / "refused").exists() else ""
        assert refusal.startswith(f"this job no longer holds checkpoint directory {checkpoints}: "), stderr[
            -3000:
        ]
        assert "torchrun run taker" in refusal
        assert "no longer holds checkpoint directory" in stderr  # its refresh said so at once, too
        assert not (checkpoints / "after").exists()
        assert (checkpoints / "before").is_dir()
        assert json.loads((checkpoints / LOCK_NAME).read_text())["run_id"] == "taker"  # left alone
        taker.check()
        taker.release()
    finally:
        process.kill()
        process.wait()


IN_NAMESPACE = """
import os, sys, time
from pathlib import Path
from spikingsail.checkpoint.lock import Holder, JobLock
directory, pid = Path(sys.argv[1]), int(sys.argv[2])
with open("/proc/sys/kernel/ns_last_pid", "w") as last:  # this namespace's next pid
    last.write(str(pid - 1))
if os.fork() == 0:
    JobLock(directory).acquire()
    (directory / "ready").write_text(str(os.getpid()))
    while not (directory / "stop").exists():
        time.sleep(0.05)
    os._exit(0)
os.wait()
"""


def _free_pid() -> int:
    """A pid that no process of this namespace has: the holder's own, in its namespace."""
    used = {int(name) for name in os.listdir("/proc") if name.isdigit()}
    return next(pid for pid in range(30000, 32000) if pid not in used)


def _can_unshare() -> bool:
    """A pid namespace of its own with its own /proc: root, util-linux's unshare, and a kernel and
    container that allow them."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--pid", "--fork", "--mount-proc", "true"]
    return subprocess.run(probe, capture_output=True, timeout=60, check=False).returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare --pid --mount-proc")
def test_a_live_holder_in_another_pid_namespace_on_this_host_keeps_its_lock(tmp_path: Path) -> None:
    """A container with the host's network: same host name, same boot, pids of its own."""
    pid = _free_pid()
    command = [
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
        sys.executable,
        "-c",
        IN_NAMESPACE,
        str(tmp_path),
        str(pid),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert (tmp_path / "ready").read_text() == str(pid)
        with pytest.raises(CheckpointError, match=rf"in use by another job: pid {pid} on host "):
            JobLock(tmp_path, replace(Holder.this_process({}), run_id="second")).acquire()
        with pytest.raises(ProcessLookupError):  # the holder's pid names no process here
            os.kill(pid, 0)
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == pid
    finally:
        (tmp_path / "stop").touch()
        process.communicate(timeout=60)


STOPPED_ACQUIRER = """
import sys, time
from dataclasses import replace
from pathlib import Path
from spikingsail.checkpoint import lock
from spikingsail.errors import CheckpointError
directory, out, call, nth = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
lock.HEARTBEAT_SECONDS, lock.STALE_SECONDS = 0.1, float(sys.argv[5])
calls = 0

def stop_before(frame, event, function):  # just before its nth os.<call>: stopped until told to go on
    global calls
    if event == "c_call" and getattr(function, "__module__", None) == "posix" and function.__name__ == call:
        calls += 1
        if calls == nth:
            (out / "stopped").touch()
            while not (out / "go").exists():
                time.sleep(0.01)

mine = lock.JobLock(directory, replace(lock.Holder.this_process({}), run_id="stopped"))
sys.setprofile(stop_before)
try:
    mine.acquire()
    outcome = "won"
except CheckpointError:
    outcome = "refused"
sys.setprofile(None)
(out / outcome).touch()
while not (out / "end").exists():
    time.sleep(0.05)
"""


def _wait_for(process: subprocess.Popen[str], *paths: Path) -> None:
    deadline = time.monotonic() + 120
    while not any(path.exists() for path in paths):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.parametrize(
    ("call", "nth", "stale"),
    [
        ("replace", 1, 60.0),  # a takeover that replaces the stale lock: judged, then stopped
        ("rename", 1, 60.0),  # with the claim, before moving the stale lock aside
        ("unlink", 1, 60.0),  # stale lock moved aside
        ("unlink", 2, 60.0),  # before giving up the claim: no lock at all meanwhile
        ("link", 2, 60.0),  # before linking its own
        pytest.param("rename", 1, 2.0, marks=pytest.mark.alone, id="rename-1-claim-goes-stale"),
    ],
)
def test_a_takeover_stopped_at_any_step_leaves_exactly_one_holder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, nth: int, stale: float
) -> None:
    """One process takes over a stale lock and is stopped just before one of its steps; meanwhile
    another tries; then the first goes on. With a short staleness the stopped one's claim goes stale
    too, the other takes the lock, and the first, going on, moves a live lock aside: it must put it back."""
    directory, out = tmp_path / "ckpt", tmp_path / "out"
    directory.mkdir()
    out.mkdir()
    write_lock(directory, replace(Holder.this_process({}), host="node7", run_id="gone"), age=3600)
    monkeypatch.setattr("spikingsail.checkpoint.lock.HEARTBEAT_SECONDS", 0.1)
    monkeypatch.setattr("spikingsail.checkpoint.lock.STALE_SECONDS", stale)
    command = [sys.executable, "-c", STOPPED_ACQUIRER, str(directory), str(out), call, str(nth), str(stale)]
    stopped = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    prompt: list[JobLock | None] = []
    try:
        _wait_for(stopped, out / "stopped", out / "won", out / "refused")

        def take() -> None:
            mine = JobLock(directory, replace(Holder.this_process({}), run_id="prompt"))
            try:
                mine.acquire()
                prompt.append(mine)
            except CheckpointError:
                prompt.append(None)

        other = threading.Thread(target=take)
        other.start()
        # it may wait for the stopped one's claim (until that is stale): then it goes on when that does
        other.join(timeout=60 if stale < 60 else 3)
        (out / "go").touch()
        other.join(timeout=120)
        assert not other.is_alive()
        _wait_for(stopped, out / "won", out / "refused")
        holders = ["prompt"] * (prompt[0] is not None) + ["stopped"] * (out / "won").exists()
        assert len(holders) == 1, holders
        assert json.loads((directory / LOCK_NAME).read_text())["run_id"] == holders[0]
        if prompt[0] is not None:
            prompt[0].check()  # still its own: a lock moved aside by mistake was put back
        assert sorted(p.name for p in directory.iterdir()) == [LOCK_NAME]
    finally:
        (out / "end").touch()
        _, stderr = stopped.communicate(timeout=60)
        if prompt and prompt[0] is not None:
            prompt[0].release()
    if stale < 60:  # the stopped one went on with a claim gone stale, and moved the other's lock
        assert "moved a live lock aside; putting it back" in stderr
