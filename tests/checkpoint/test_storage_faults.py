"""Storage faults on real filesystems: a tmpfs that fills during a save, one remounted read-only,
a checkpoint directory deleted mid-run or read-only from the start, and damaged checkpoints on load.

Nothing may be lost (``latest`` and the last good checkpoint stay, no staging directory is left),
every rank must hear of the failure, and the launcher's terminal must end with one message naming
the cause, the path and the last good checkpoint. Mounting needs root (as in CI).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import spikingsail
from spikingsail.checkpoint.faults import Failure, save_error
from spikingsail.checkpoint.store import CheckpointStore
from spikingsail.engine.engine import Engine
from spikingsail.environments import RankInfo
from spikingsail.errors import CheckpointError
from tests.tmpfs import mounted_tmpfs

JOB = Path(__file__).with_name("jobs") / "storage_job.py"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MB tmpfs (room for a few 2 MB checkpoints), unmounted whatever the test did to it."""
    with mounted_tmpfs(tmp_path / "mnt", "16m") as mount:
        yield mount


def launch(
    out: Path, checkpoints: Path, *extra: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "spikingsail.cli.main", "launch", "-n", "2", str(JOB), str(out),
               "--checkpoints-path", str(checkpoints), "--resume", *extra]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


def reason(result: subprocess.CompletedProcess[str]) -> str:
    """The failure reason `sail launch` prints last."""
    assert "sail launch: " in result.stderr, result.stderr[-3000:]
    return result.stderr.rsplit("sail launch: ", 1)[1]


def ranks(out: Path) -> list[dict[str, object]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def assert_kept(checkpoints: Path, tags: list[str]) -> None:
    store = CheckpointStore(checkpoints)
    assert store.tags() == tags and store.latest() == tags[-1]
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith((".staging-", ".latest"))]


@root_only
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("backend", "background"), [("ddp", False), ("ddp", True), ("fsdp", False), ("deepspeed", False)]
)
def test_a_disk_that_fills_during_a_save(tmp_path: Path, tmpfs: Path, backend: str, background: bool) -> None:
    """on_error continue: warned on every rank and in the metrics file, later saves succeed once space is
    freed. on_error stop: exit 1 with the cause, nothing lost, and the resume ends bit-identical."""
    checkpoints, extra = tmpfs / "ck", ["--backend", backend, *(["--async"] if background else [])]
    go_on = launch(tmp_path / "continued", checkpoints, *extra, "--fill-at", "4", "--free-at", "6")
    assert go_on.returncode == 0, go_on.stderr[-3000:]
    for rank in (0, 1):
        warned = [line for line in go_on.stderr.splitlines() if line.startswith(f"[rank{rank}]") and
                  "checkpoint global_step4 could not be saved" in line]  # fmt: skip
        assert warned and "the disk is full" in warned[0], go_on.stderr[-3000:]
    events = [
        json.loads(line) for line in (tmp_path / "continued" / "metrics.jsonl").read_text().splitlines()
    ]
    failed = [e for e in events if "event" in e]  # a background save's failure is known a step or two later
    assert len(failed) == 1 and failed[0]["event"] == "checkpoint_failed" and 4 <= failed[0]["step"] <= 6
    assert failed[0]["message"].startswith("checkpoint global_step4 could not be saved")
    assert_kept(checkpoints, ["global_step6", "global_step8"])

    shutil.rmtree(checkpoints)
    stopped = launch(tmp_path / "stopped", checkpoints, *extra, "--on-error", "stop", "--fill-at", "4")
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    why = reason(stopped)
    assert f"checkpoint global_step4 could not be saved in {checkpoints}: the disk is full" in why
    assert "MB are free on" in why and str(tmpfs) in why
    assert "the last good checkpoint, global_step2, is intact and still 'latest'" in why
    assert "Traceback" not in why
    assert_kept(checkpoints, ["global_step2"])
    if background:  # it surfaced on both ranks at the same step (or at close), never lost in the thread
        progress = [(tmp_path / "stopped" / f"progress{r}").read_text() for r in (0, 1)]
        assert progress[0] == progress[1] and int(progress[0]) >= 4

    (tmpfs / "filler").unlink()
    resumed = launch(tmp_path / "stopped", checkpoints, *extra)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["started_at"] for r in ranks(tmp_path / "stopped")] == [2, 2]
    assert ranks(tmp_path / "stopped") == [{**r, "started_at": 2} for r in ranks(tmp_path / "continued")]


@root_only
def test_a_preemption_save_that_fills_the_disk_exits_1_with_the_cause_not_75(
    tmp_path: Path, tmpfs: Path
) -> None:
    """A requeue (status 75) would promise a checkpoint of this step; the job stops with the error instead."""
    checkpoints = tmpfs / "ck"
    command = [sys.executable, str(JOB), str(tmp_path / "out"), "--checkpoints-path", str(checkpoints),
               "--resume", "--fill-at", "3", "--signal-at", "3"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    assert (
        "checkpoint global_step3 could not be saved" in result.stderr and "the disk is full" in result.stderr
    )
    assert "preempted by signal" not in result.stderr and "Traceback" not in result.stderr
    assert_kept(checkpoints, ["global_step2"])


UNCLOSED = """
import resource, signal, sys, torch, spikingsail
from spikingsail.environments import RankInfo
config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
          "sail": {"progress_bar": False}}
engine, _ = spikingsail.initialize(model=torch.nn.Linear(512, 512), config=config, rank_info=RankInfo.single())
engine.backward(engine(torch.ones(1, 512)).sum()); engine.step()
engine.save_checkpoint(sys.argv[1], tag="good")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
engine.save_checkpoint(sys.argv[1], tag="too-big", async_save=True)
print("the script ends without close()", flush=True)
"""


def test_a_background_save_that_fails_after_the_script_ends_still_fails_the_process(tmp_path: Path) -> None:
    script = tmp_path / "unclosed.py"
    script.write_text(UNCLOSED)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "ck")], capture_output=True, text=True,
                            timeout=120, check=False)  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stdout.strip() == "the script ends without close()"
    assert (
        "[rank0] checkpoint too-big could not be saved in" in result.stderr and "(ulimit -f)" in result.stderr
    )
    assert "Traceback" not in result.stderr
    assert_kept(tmp_path / "ck", ["good"])


@root_only
@pytest.mark.multiprocess
def test_a_checkpoint_directory_remounted_read_only_mid_run(tmp_path: Path, tmpfs: Path) -> None:
    checkpoints = tmpfs / "ck"
    result = launch(
        tmp_path / "out", checkpoints, "--on-error", "stop", "--fault", "remount-ro", "--fault-at", "3"
    )
    assert result.returncode == 1, result.stderr[-3000:]
    why = reason(result)
    assert f"checkpoint global_step4 could not be saved in {checkpoints}: the filesystem is read-only" in why
    assert f"remount {tmpfs} (tmpfs on tmpfs) read-write" in why and "global_step2, is intact" in why
    assert_kept(checkpoints, ["global_step2"])


@pytest.mark.multiprocess
def test_a_checkpoint_directory_deleted_mid_run_is_reported_and_not_made_again(tmp_path: Path) -> None:
    checkpoints = tmp_path / "ck"
    result = launch(tmp_path / "out", checkpoints, "--fault", "delete", "--fault-at", "3")
    assert result.returncode == 0, result.stderr[-3000:]  # on_error continue: the run finishes
    vanished = [line for line in result.stderr.splitlines()
                if f"could not be saved: the checkpoint directory {checkpoints} vanished" in line]  # fmt: skip
    for rank in (0, 1):  # the saves at steps 4, 6 and 8, on every rank
        assert len([line for line in vanished if line.startswith(f"[rank{rank}]")]) == 3, result.stderr[
            -3000:
        ]
    assert not checkpoints.exists()


@root_only
@pytest.mark.multiprocess
def test_a_read_only_checkpoint_directory_is_refused_before_the_first_step(
    tmp_path: Path, tmpfs: Path
) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    result = launch(tmp_path / "out", tmpfs / "ck", timeout=240)
    assert result.returncode == 1, result.stderr[-3000:]
    why = reason(result)
    assert f"cannot save checkpoints in {tmpfs / 'ck'}: 2 of 2 rank(s) cannot write there" in why
    assert "the filesystem is read-only" in why
    assert not list((tmp_path / "out").glob("progress*")), "a step was taken"


def engine(checkpoints: Path, width: int, *, single: bool = True) -> Engine:
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "checkpoint": {"keep_last": 2}, "sail": {"progress_bar": False}}  # fmt: skip
    e, _ = spikingsail.initialize(model=torch.nn.Linear(width, width), config=config,
                                  rank_info=RankInfo.single() if single else None,
                                  checkpoints_path=str(checkpoints))  # fmt: skip
    return e


@root_only
def test_too_small_a_filesystem_is_refused_or_warned_before_the_first_step(
    tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 1024² fp32 weights and Adam's two moments: ~12.6 MB a checkpoint, on 16 MB
    with pytest.raises(CheckpointError, match=r"has no room for one checkpoint") as refused:
        engine(tmpfs / "ck", 2048)
    assert "a checkpoint of this model and optimizer takes about 50.4 MB" in str(refused.value)
    e = engine(tmpfs / "ck", 1024)
    e.close()
    assert "has room for 1 checkpoint(s), not the 3 that keep_last needs" in caplog.text
    assert "takes about 12.6 MB" in caplog.text


def two_checkpoints(root: Path) -> None:
    e = engine(root, 4)
    for _ in range(2):
        e.backward(e(torch.ones(1, 4)).sum())
        e.step()
        e.save_checkpoint(root)
    e.close()


def test_a_vanished_latest_checkpoint_is_skipped_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    two_checkpoints(tmp_path)
    shutil.rmtree(tmp_path / "global_step2")
    e = engine(tmp_path, 4)
    path, _ = e.load_checkpoint(tmp_path)
    assert path.endswith("global_step1") and e.global_steps == 1
    assert "'latest' names global_step2, which is missing" in caplog.text
    assert "resuming from global_step1 instead" in caplog.text
    e.close()


def refuse_when_none_loads(root: str) -> str:
    e = engine(Path(root), 4, single=False)
    try:
        e.load_checkpoint(root)
    except CheckpointError as err:
        return err.what
    finally:
        e.close()
    return "loaded"


@pytest.mark.multiprocess
def test_when_no_checkpoint_loads_every_rank_fails_loudly(tmp_path: Path) -> None:
    from tests.multiprocess import run_ranks

    two_checkpoints(tmp_path)
    (tmp_path / "global_step1" / "engine.pt").unlink()
    data = tmp_path / "global_step2" / "engine.pt"
    data.write_bytes(data.read_bytes()[:-8])  # truncated
    outcomes = run_ranks(refuse_when_none_loads, 2, str(tmp_path))
    assert outcomes == {
        r: f"no loadable checkpoint in {tmp_path} ('latest' names global_step2)" for r in (0, 1)
    }


@pytest.mark.parametrize(
    ("code", "words", "fix"),
    [
        (errno.EACCES, "permission denied", f"writable by user {os.getuid()}"),
        (errno.EIO, "an I/O error (the disk or the network filesystem failed)", "dmesg"),
        (errno.EROFS, "the filesystem is read-only", "read-write"),
        (errno.EDQUOT, "the disk quota is exceeded", "free space there"),
    ],
)
def test_each_cause_is_named_with_what_to_do(tmp_path: Path, code: int, words: str, fix: str) -> None:
    failure = Failure(
        1, code, str(tmp_path / ".staging-x" / "f"), f"OSError: [Errno {code}] {os.strerror(code)}"
    )
    err = save_error([failure], tmp_path, "global_step9", full=False, needed=10**6, last_good="global_step8")
    assert err.what == f"checkpoint global_step9 could not be saved in {tmp_path}: {words}"
    assert f"rank 1: OSError: [Errno {code}]" in err.why
    assert "the last good checkpoint, global_step8, is intact" in err.fix and fix in err.fix


def test_a_write_that_failed_without_an_errno_on_a_disk_without_room_is_a_full_disk(tmp_path: Path) -> None:
    """torch.save reports ENOSPC as "unexpected pos": no errno, and the checkpoint did not fit."""
    failure = Failure(
        0, None, None, "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 2176 vs 2070"
    )
    full = save_error(
        [failure], tmp_path, "global_step4", full=True, needed=2 * 10**6, last_good="global_step2"
    )
    assert full.what.endswith(": the disk is full") and "a checkpoint takes about 2.0 MB" in full.why
    other = save_error(
        [failure], tmp_path, "global_step4", full=False, needed=2 * 10**6, last_good="global_step2"
    )
    assert other.what.endswith(": the write failed") and "unexpected pos" in other.why
