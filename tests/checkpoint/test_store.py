"""Crash safety and integrity: real truncated files, flipped bytes, unsafe pickles and a SIGKILL mid-write."""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import spikingsail
from spikingsail.checkpoint.store import CheckpointStore
from spikingsail.environments import RankInfo
from spikingsail.errors import CheckpointError


def engine(checkpoint: dict[str, object] | None = None) -> spikingsail.Engine:
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "sail": {"progress_bar": False}, "checkpoint": checkpoint or {}}  # fmt: skip
    built, _ = spikingsail.initialize(model=torch.nn.Linear(3, 2), config=config, rank_info=RankInfo.single())
    return built


def step(e: spikingsail.Engine) -> None:
    e.backward(e(torch.ones(2, 3)).sum())
    e.step()


@pytest.fixture
def two_checkpoints(tmp_path: Path) -> Path:
    e = engine()
    step(e)
    e.save_checkpoint(tmp_path)
    step(e)
    e.save_checkpoint(tmp_path)
    e.close()
    assert CheckpointStore(tmp_path).tags() == ["global_step1", "global_step2"]
    assert (tmp_path / "latest").read_text() == "global_step2"
    return tmp_path


def test_truncated_file_is_named_and_latest_falls_back(
    two_checkpoints: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = two_checkpoints / "global_step2" / "state" / "__0_0.distcp"
    model.write_bytes(model.read_bytes()[:-10])
    with pytest.raises(
        CheckpointError, match=r"global_step2/state/__0_0\.distcp is truncated or overwritten"
    ):
        CheckpointStore(two_checkpoints).verify("global_step2")
    e = engine()
    with caplog.at_level(logging.WARNING):
        path, _ = e.load_checkpoint(two_checkpoints)
    assert path.endswith("global_step1") and e.global_steps == 1
    assert "__0_0.distcp is truncated" in caplog.text and "resuming from global_step1 instead" in caplog.text
    with pytest.raises(CheckpointError, match="truncated"):
        e.load_checkpoint(two_checkpoints, "global_step2")
    e.close()


def test_flipped_byte_is_caught(two_checkpoints: Path) -> None:
    metadata = two_checkpoints / "global_step2" / "state" / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[len(data) // 2] ^= 0x01
    metadata.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"state/\.metadata is corrupt: its SHA-256 differs"):
        CheckpointStore(two_checkpoints).verify("global_step2")
    assert CheckpointStore(two_checkpoints).resolve(None) == "global_step1"


def test_nothing_loadable(two_checkpoints: Path) -> None:
    for manifest in two_checkpoints.glob("*/manifest.json"):
        manifest.write_text("{not json")
    with pytest.raises(CheckpointError, match="no loadable checkpoint"):
        CheckpointStore(two_checkpoints).resolve(None)


def test_an_unsafe_pickle_is_refused_even_with_a_matching_manifest(two_checkpoints: Path) -> None:
    target = two_checkpoints / "global_step2" / "engine.pt"
    target.write_bytes(pickle.dumps(subprocess.Popen))  # would import and run code with weights_only=False
    manifest_path = two_checkpoints / "global_step2" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    import hashlib

    manifest["files"]["engine.pt"] = {"size": target.stat().st_size,
                                      "sha256": hashlib.sha256(target.read_bytes()).hexdigest()}  # fmt: skip
    manifest_path.write_text(json.dumps(manifest))
    e = engine()
    with pytest.raises(CheckpointError, match=r"cannot read .*engine\.pt") as err:
        e.load_checkpoint(two_checkpoints, "global_step2")
    assert "tensors and plain data" in str(err.value)
    e.close()


def test_client_state_must_be_plain_data(tmp_path: Path) -> None:
    e = engine()
    import random

    with pytest.raises(CheckpointError, match=r"client_state\['sampler'\] is a Random"):
        e.save_checkpoint(tmp_path, client_state={"epoch": 3, "sampler": random.Random()})
    path = e.save_checkpoint(
        tmp_path, client_state={"epoch": 3, "best": torch.tensor(0.5), "tags": ["a", None]}
    )
    _, client = e.load_checkpoint(tmp_path)
    assert (
        client["epoch"] == 3
        and client["tags"] == ["a", None]
        and torch.equal(client["best"], torch.tensor(0.5))
    )
    assert path.endswith("global_step0")
    e.close()


def test_automatic_saves_keep_the_last_k(tmp_path: Path) -> None:
    e = engine({"path": str(tmp_path), "interval_steps": 2, "keep_last": 2})
    for _ in range(7):
        step(e)
    e.close()
    assert CheckpointStore(tmp_path).tags() == ["global_step4", "global_step6"]


WRITER = """
import sys, torch, spikingsail
from spikingsail.environments import RankInfo
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)])
config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
          "sail": {"progress_bar": False}}
engine, _ = spikingsail.initialize(model=model, config=config, rank_info=RankInfo.single())
engine.backward(engine(torch.ones(1, 2048)).sum()); engine.step()
engine.save_checkpoint(sys.argv[1], tag="good")
print("saved", flush=True)
while True:
    engine.backward(engine(torch.ones(1, 2048)).sum()); engine.step()
    engine.save_checkpoint(sys.argv[1], tag="doomed")
"""


@pytest.mark.multiprocess
def test_sigkill_during_a_write_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    root = tmp_path / "ckpt"
    writer = subprocess.Popen([sys.executable, str(script), str(root)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None and writer.stdout.readline().strip() == "saved"
    staging = root / ".staging-doomed"
    deadline = time.monotonic() + 60
    while not any((staging / "state").glob("*.distcp")):  # kill while the big file is being written
        assert time.monotonic() < deadline, "the second save never started"
        time.sleep(0.01)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    store = CheckpointStore(root)
    assert store.latest() == "good"
    assert "doomed" not in store.tags()
    assert store.resolve(None) == "good"
    e_dir = root
    resumed, _ = spikingsail.initialize(
        model=torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)]),
        config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                "sail": {"progress_bar": False}},
        rank_info=RankInfo.single(), checkpoints_path=str(e_dir), resume=True,
    )  # fmt: skip
    assert resumed.global_steps == 1
    resumed.save_checkpoint(root, tag="after")  # a new save clears the dead staging directory
    assert not staging.exists()
    resumed.close()


def test_automatic_saves_land_on_step_boundaries_with_accumulation(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "sail": {"progress_bar": False},
              "checkpoint": {"path": str(tmp_path), "interval_steps": 1}}  # fmt: skip
    e, _ = spikingsail.initialize(model=torch.nn.Linear(3, 2), config=config, rank_info=RankInfo.single())
    for _ in range(4):
        step(e)
    e.close()
    store = CheckpointStore(tmp_path)
    assert store.tags() == ["global_step1", "global_step2"]
    for tag, steps in (("global_step1", 1), ("global_step2", 2)):
        assert store.metadata(tag)["micro_steps"] == 2 * steps
        assert not (tmp_path / tag / "grads").exists(), "a boundary save has no partial window"


FULL_DISK = """
import resource, signal, sys, torch, spikingsail
from spikingsail.checkpoint.store import CheckpointStore
from spikingsail.errors import CheckpointError
from spikingsail.environments import RankInfo
config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
          "sail": {"progress_bar": False}}
engine, _ = spikingsail.initialize(model=torch.nn.Linear(512, 512), config=config, rank_info=RankInfo.single())
engine.backward(engine(torch.ones(1, 512)).sum()); engine.step()
engine.save_checkpoint(sys.argv[1], tag="good")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
for background in (False, True):
    try:
        engine.save_checkpoint(sys.argv[1], tag="too-big", async_save=background)
        engine.wait_for_checkpoint()
    except CheckpointError as err:
        print("refused:", str(err).replace("\\n", " | "), flush=True)
store = CheckpointStore(sys.argv[1])
print("latest:", store.latest(), store.tags(), flush=True)
engine.close()
"""


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    refusals = [line for line in result.stdout.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 2, result.stdout
    # the synchronous save and the background one fail alike, naming the cause and the kept checkpoint
    for refusal in refusals:
        assert "checkpoint too-big could not be saved in" in refusal and "(ulimit -f)" in refusal
        assert "why: rank 0: OSError: [Errno 27] File too large" in refusal
        assert "the last good checkpoint, good, is intact and still 'latest'" in refusal
    assert not list((tmp_path / "ckpt").glob(".staging-*"))
    assert "latest: good ['good']" in result.stdout


def seal_fails_on_rank_one(root: str) -> str:
    """Rank 1 cannot seal its files (fault injected at the seal step); every rank must hear of it."""
    import torch.distributed as dist

    from spikingsail.checkpoint import engine_state

    e, _ = spikingsail.initialize(model=torch.nn.Linear(3, 2), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "sail": {"progress_bar": False}})  # fmt: skip
    e.save_checkpoint(root, tag="good")
    if dist.get_rank() == 1:
        real_seal = engine_state.seal

        def failing(staging: Path, paths: list[Path]) -> dict[str, object]:
            if "doomed" in str(staging):
                raise OSError("Input/output error")
            return real_seal(staging, paths)

        engine_state.seal = failing  # type: ignore[assignment]
    try:
        e.save_checkpoint(root, tag="doomed")
    except CheckpointError as err:
        outcome = str(err).splitlines()[1]
    else:
        outcome = "saved"
    e.close()
    return outcome


@pytest.mark.multiprocess
def test_a_rank_that_cannot_seal_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    from tests.multiprocess import run_ranks

    outcomes = run_ranks(seal_fails_on_rank_one, 2, str(tmp_path))
    assert outcomes == {
        0: "  why: rank 1: OSError: Input/output error",
        1: "  why: rank 1: OSError: Input/output error",
    }
    assert CheckpointStore(tmp_path).latest() == "good" and CheckpointStore(tmp_path).tags() == ["good"]


RESAVER = """
import os, signal, sys, torch, spikingsail
from spikingsail.environments import RankInfo
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "sail": {"progress_bar": False}}
torch.manual_seed(0)
engine, _ = spikingsail.initialize(model=torch.nn.Linear(3, 2), config=config, rank_info=RankInfo.single())
engine.backward(engine(torch.ones(2, 3)).sum()); engine.step()
engine.save_checkpoint(sys.argv[1], tag="same")
print("saved", flush=True)
engine.backward(engine(torch.ones(2, 3)).sum()); engine.step()
real_replace = os.replace
def dying_replace(src, dst):
    if os.path.basename(str(src)).startswith(".staging-"):  # the new checkpoint is about to go in
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)
os.replace = dying_replace
engine.save_checkpoint(sys.argv[1], tag="same")
"""


def test_a_crash_while_a_tag_is_saved_again_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    script = tmp_path / "resaver.py"
    script.write_text(RESAVER)
    root = tmp_path / "ckpt"
    result = subprocess.run(
        [sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert result.stdout.split() == ["saved"]
    store = CheckpointStore(root)
    assert store.latest() == "same"
    assert store.resolve(None) == "same"  # put back from where the re-save moved it
    assert store.metadata("same")["global_steps"] == 1
    resumed = engine({"path": str(root)})
    resumed.load_checkpoint(root)
    assert resumed.global_steps == 1
    resumed.close()


def test_a_resume_whose_latest_names_a_lost_checkpoint_fails_loudly(two_checkpoints: Path) -> None:
    store = CheckpointStore(two_checkpoints)
    for tag in store.tags():
        shutil.rmtree(two_checkpoints / tag)
    assert store.latest() is not None
    with pytest.raises(CheckpointError, match=r"no loadable checkpoint in .*'latest' names global_step2"):
        spikingsail.initialize(
            model=torch.nn.Linear(3, 2),
            config={"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                    "sail": {"progress_bar": False}},
            rank_info=RankInfo.single(), checkpoints_path=str(two_checkpoints), resume=True,
        )  # fmt: skip
