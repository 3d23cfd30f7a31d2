"""Checkpoints whose manifest or engine.pt is not what the engine writes, and model files that do not
fit on the disk: each ends in one message (what, why, fix) and a non-zero exit, never a traceback;
nothing is lost; and a damaged newest checkpoint makes an export or a resume fall back to the older
good one, as other damage does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import spikingsail
from spikingsail.checkpoint.export import read_saved_model
from spikingsail.checkpoint.replica_dirs import newest_group_checkpoints
from spikingsail.checkpoint.store import CheckpointStore
from spikingsail.errors import CheckpointError
from tests.checkpoint.damaged import NEWER, OLDER, copy_run, reseal, sail, write_run
from tests.tmpfs import mounted_tmpfs


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("run") / "ck")


MANIFESTS = {
    "no files": lambda m: {k: v for k, v in m.items() if k != "files"},
    "a list": lambda m: [m],
    "files a list": lambda m: {**m, "files": list(m["files"])},
    "a steps string": lambda m: {**m, "global_steps": "x"},
    "a fractional world size": lambda m: {**m, "world_size": 1.5},
    "a size string": lambda m: {**m, "files": {n: {**e, "size": "12"} for n, e in m["files"].items()}},
    "a path outside": lambda m: {**m, "files": {"../../etc/passwd": next(iter(m["files"].values()))}},
    "an infinite time": lambda m: {**m, "created": float("inf")},
}


@pytest.mark.parametrize("damage", sorted(MANIFESTS))
def test_a_manifest_of_another_shape_is_listed_damaged_and_export_falls_back(
    run: Path, tmp_path: Path, damage: str
) -> None:
    ck = copy_run(run, tmp_path / "ck")
    manifest = ck / NEWER / "manifest.json"
    manifest.write_text(json.dumps(MANIFESTS[damage](json.loads(manifest.read_text()))))
    listed = sail("checkpoint", "ls", str(ck))
    assert listed.code == 1
    assert f"{NEWER} *  ?" in listed.out and "DAMAGED" in listed.out
    assert f"{NEWER}: DAMAGED: {manifest} is corrupt" in listed.out
    assert OLDER in listed.out and "1 of 2 checkpoint(s) cannot be read" in listed.err
    verified = sail("checkpoint", "verify", str(ck))
    assert verified.code == 1 and f"{NEWER}: BAD: {manifest} is corrupt" in verified.out
    exported = sail("checkpoint", "export", str(ck), "--out", str(tmp_path / "m.pt"))
    assert exported.code == 0, exported.err
    assert f"from {OLDER}" in exported.out and f"resuming from {OLDER} instead" in exported.err
    with pytest.raises(CheckpointError, match="is corrupt"):
        CheckpointStore(ck).metadata(NEWER)
    assert CheckpointStore(ck).latest() == NEWER  # nothing moved or deleted


def test_an_undecodable_manifest_and_latest_pointer(run: Path, tmp_path: Path) -> None:
    ck = copy_run(run, tmp_path / "ck")
    (ck / NEWER / "manifest.json").write_bytes(b'{"files": {"\xff\xfe": 1}}')
    listed = sail("checkpoint", "ls", str(ck))
    assert listed.code == 1 and "is corrupt (byte 12 is not UTF-8)" in listed.out
    (ck / "latest").write_bytes(b"\xff\xfe")
    exported = sail("checkpoint", "export", str(ck), "--out", str(tmp_path / "m.safetensors"))
    assert exported.code == 0 and f"from {OLDER}" in exported.out, exported.err


def test_a_tag_that_is_not_a_directory_name_is_refused(run: Path) -> None:
    said = sail("checkpoint", "export", str(run), "--tag", "/etc", "--out", "m.pt")
    assert said.code == 2 and "checkpoint tag '/etc' is not a plain directory name" in said.err


def test_an_engine_file_that_is_not_a_dict(run: Path, tmp_path: Path) -> None:
    ck = copy_run(run, tmp_path / "ck")
    torch.save([1, 2, 3], ck / NEWER / "engine.pt")
    reseal(ck / NEWER, "engine.pt")
    listed = sail("checkpoint", "ls", str(ck))
    assert listed.code == 1 and "is not a SpikingSail engine file" in listed.out
    named = sail("checkpoint", "export", str(ck), "--tag", NEWER, "--out", str(tmp_path / "m.pt"))
    assert named.code == 2 and "it holds a list, not a dict" in named.err and "fix:" in named.err
    exported = sail("checkpoint", "export", str(ck), "--out", str(tmp_path / "m.pt"))
    assert exported.code == 0 and f"from {OLDER}" in exported.out, exported.err
    engine, _ = spikingsail.initialize(model=torch.nn.Linear(3, 2), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "sail": {"progress_bar": False, "seed": 1}})  # fmt: skip
    with pytest.raises(CheckpointError, match="it holds a list, not a dict"):
        engine.load_checkpoint(ck, NEWER)
    path, _ = engine.load_checkpoint(ck)  # a resume without a tag falls back, as an export does
    assert Path(path) == ck / OLDER and engine.global_steps == 2
    engine.close()


def test_an_engine_file_whose_config_is_not_json(run: Path, tmp_path: Path) -> None:
    ck = copy_run(run, tmp_path / "ck")
    engine_file = ck / NEWER / "engine.pt"
    torch.save({**torch.load(engine_file, weights_only=True), "config": "{"}, engine_file)
    reseal(ck / NEWER, "engine.pt")
    named = sail("checkpoint", "export", str(ck), "--tag", NEWER, "--out", str(tmp_path / "m.pt"))
    assert named.code == 2 and "its 'config' is not JSON" in named.err


LIMITED = """
import resource, signal, sys
from spikingsail.cli.main import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_export_past_the_file_size_limit(run: Path, tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"model{suffix}"
    result = subprocess.run([sys.executable, "-c", LIMITED, "16", "checkpoint", "export", str(run), "--out", str(out)],
                            capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert (
        f"sail checkpoint: could not write {out}: the file would exceed the file size limit" in result.stderr
    )
    assert "ulimit -f" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no part of a file left


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@root_only
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_save_model_on_a_full_disk(tmp_path: Path, suffix: str) -> None:
    with mounted_tmpfs(tmp_path / "mnt", "1m") as mount:
        engine, _ = spikingsail.initialize(model=torch.nn.Linear(512, 1024), config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "sail": {"progress_bar": False}})  # fmt: skip
        (mount / "kept.pt").write_bytes(b"x" * 1000)
        with pytest.raises(CheckpointError) as caught:
            engine.save_model(mount / f"model{suffix}")
        assert caught.value.what == f"could not write {mount / f'model{suffix}'}: the disk is full"
        assert "the model takes about 2.1 MB" in caught.value.why and "free space there" in caught.value.fix
        assert sorted(p.name for p in mount.iterdir()) == ["kept.pt"]
        small = engine.save_model(tmp_path / f"small{suffix}", dtype=torch.bfloat16)
        assert small is not None and len(read_saved_model(small)) == 2
        engine.close()


def test_a_resume_falls_back_from_a_manifest_of_another_shape(run: Path, tmp_path: Path) -> None:
    ck = copy_run(run, tmp_path / "ck")
    (ck / NEWER / "manifest.json").write_text("[]")
    engine, _ = spikingsail.initialize(model=torch.nn.Linear(3, 2), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "sail": {"progress_bar": False, "seed": 1}})  # fmt: skip
    path, _ = engine.load_checkpoint(ck)
    assert Path(path) == ck / OLDER and engine.global_steps == 2
    engine.close()


@pytest.mark.parametrize("damage", ["[]", '{"files": {}, "global_steps": [4]}'])
def test_a_replica_group_with_a_damaged_manifest_is_ranked_last(
    run: Path, tmp_path: Path, damage: str
) -> None:
    """Where a restarted group continues from: the other group's directory, not a traceback."""
    good, damaged = copy_run(run, tmp_path / "replica-0"), copy_run(run, tmp_path / "replica-1")
    (damaged / NEWER / "manifest.json").write_text(damage)
    assert newest_group_checkpoints(tmp_path) == good
