"""DCP's files are read without running code: a hostile .metadata or value is refused, not executed."""

from __future__ import annotations

import enum
import hashlib
import io
import json
import os
import pathlib
import pickle
import types
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

import spikingsail
from spikingsail.checkpoint import dcp_io
from spikingsail.environments import RankInfo
from spikingsail.errors import CheckpointError


class Payload:
    """Unpickling this would create ``marker``: the proof that a load ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def engine() -> spikingsail.Engine:
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
              "sail": {"progress_bar": False}}  # fmt: skip
    built, _ = spikingsail.initialize(model=torch.nn.Linear(3, 2), config=config, rank_info=RankInfo.single())
    return built


def reseal(checkpoint: Path, name: str) -> None:
    """Update the manifest for a replaced file, as an attacker with write access would."""
    manifest_path = checkpoint / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    data = (checkpoint / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


def saved(tmp_path: Path) -> tuple[spikingsail.Engine, Path]:
    """An engine after one step, and the checkpoint it saved under ``tmp_path / "ckpt"``."""
    e = engine()
    e.backward(e(torch.ones(2, 3)).sum())
    e.step()
    return e, Path(e.save_checkpoint(tmp_path / "ckpt"))


def test_hostile_metadata_is_refused(tmp_path: Path) -> None:
    e, checkpoint = saved(tmp_path)
    marker = tmp_path / "ran"
    (checkpoint / "state" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    reseal(checkpoint, "state/.metadata")
    with pytest.raises(CheckpointError, match=r"metadata refers to posix\.system") as err:
        e.load_checkpoint(tmp_path / "ckpt")
    assert "could run code on load" in str(err.value)
    assert not marker.exists()
    e.close()


class EnumsByName(pickle.Pickler):
    """Pickles enum members as early Python 3.11 releases do (3.11.2): ``getattr(EnumClass, "NAME")``."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


class Getattr:
    """Unpickles as ``getattr(owner, name)``: the enum form, pointed at something else."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self) -> tuple[Any, ...]:
        return (getattr, (self.owner, self.name))


def test_metadata_written_by_python_3_11_2_loads(tmp_path: Path) -> None:
    e, checkpoint = saved(tmp_path)
    metadata = checkpoint / "state" / ".metadata"
    with metadata.open("rb") as handle:
        trusted = pickle.load(handle)  # our own file, just written
    by_name = io.BytesIO()
    EnumsByName(by_name, protocol=pickle.HIGHEST_PROTOCOL).dump(trusted)
    assert b"getattr" in by_name.getvalue() and b"_MEM_FORMAT_ENCODING" in by_name.getvalue()
    metadata.write_bytes(by_name.getvalue())
    reseal(checkpoint, "state/.metadata")
    weights = [p.detach().clone() for p in e.module.parameters()]
    with torch.no_grad():
        for p in e.module.parameters():
            p.zero_()
    e.load_checkpoint(tmp_path / "ckpt")
    for p, w in zip(e.module.parameters(), weights, strict=True):
        assert torch.equal(p, w)
    e.close()


@pytest.mark.parametrize(
    ("owner", "name", "named"),
    [
        (pathlib.PosixPath, "__new__", r"getattr\(<class 'pathlib\.PosixPath'>, '__new__'\)"),
        (
            _MEM_FORMAT_ENCODING,
            "__init__",
            r"getattr\(<enum '_MEM_FORMAT_ENCODING'>, '__init__'\)",
        ),
    ],
)
def test_getattr_in_metadata_is_refused_but_for_a_member_of_dcps_enums(
    tmp_path: Path, owner: Any, name: str, named: str
) -> None:
    e, checkpoint = saved(tmp_path)
    (checkpoint / "state" / ".metadata").write_bytes(pickle.dumps(Getattr(owner, name)))
    reseal(checkpoint, "state/.metadata")
    with pytest.raises(CheckpointError, match=f"metadata refers to {named}") as err:
        e.load_checkpoint(tmp_path / "ckpt")
    assert "could run code on load" in str(err.value)
    e.close()


class Stage(enum.Enum):
    WEIGHTS = 3


def test_a_weights_only_file_with_enums_pickled_by_name_loads_and_its_getattr_reaches_only_members(
    tmp_path: Path,
) -> None:
    """DeepSpeed's own files (its ZeRO stage enum) as Python 3.11.2 writes them."""
    by_name = types.ModuleType("enums_by_name")
    by_name.Pickler = EnumsByName  # type: ignore[attr-defined]
    path, other = tmp_path / "state.pt", tmp_path / "other.pt"
    torch.save({"stage": Stage.WEIGHTS, "weight": torch.ones(2)}, path, pickle_module=by_name)
    with zipfile.ZipFile(path) as archive:
        assert b"getattr" in archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    loaded = dcp_io.load_weights_only(path, allowed_globals=[Stage])
    assert loaded["stage"] is Stage.WEIGHTS and torch.equal(loaded["weight"], torch.ones(2))
    torch.save({"stage": Getattr(Stage, "__init__")}, other)
    with pytest.raises(CheckpointError, match=r"cannot read .*other\.pt"):
        dcp_io.load_weights_only(other, allowed_globals=[Stage])


def test_a_value_that_is_not_plain_data_is_refused(tmp_path: Path) -> None:
    e = engine()
    e.backward(e(torch.ones(2, 3)).sum())
    e.step()
    marker = tmp_path / "ran"
    state = dcp_io.state_to_save(e.module, e.optimizer)
    key = next(k for k in state["optimizer"] if k.startswith("param_groups.") and k.endswith(".lr"))
    state["optimizer"][key] = Payload(marker)
    dcp_io.save(state, tmp_path / "state", None)
    with pytest.raises(
        CheckpointError, match=r"'optimizer\.param_groups\.[a-z0-9_.]+\.lr' in the checkpoint cannot be read"
    ):
        dcp_io.load(e.module, e.optimizer, tmp_path / "state", None)
    assert not marker.exists()
    e.close()


def test_plain_values_and_tensors_load(tmp_path: Path) -> None:
    saved = {"model": {"w": torch.arange(4.0)}, "extra": {"betas": (0.9, 0.99), "name": "x", "n": None}}
    dcp_io.save(saved, tmp_path / "state", None)
    target: dict[str, Any] = {"model": {"w": torch.zeros(4)}, "extra": {"betas": None, "name": None, "n": 1}}
    dcp_load(target, storage_reader=dcp_io.SafeFileSystemReader(tmp_path / "state"),
             planner=dcp_io.SafeLoadPlanner(), no_dist=True)  # fmt: skip
    assert torch.equal(target["model"]["w"], torch.arange(4.0))
    assert target["extra"] == {"betas": (0.9, 0.99), "name": "x", "n": None}


def test_a_different_model_is_named(tmp_path: Path) -> None:
    e = engine()
    e.save_checkpoint(tmp_path)
    e.close()
    other, _ = spikingsail.initialize(
        model=torch.nn.Linear(3, 5),
        config={"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
                "sail": {"progress_bar": False}},
        rank_info=RankInfo.single(),
    )  # fmt: skip
    with pytest.raises(CheckpointError, match="cannot load the model/optimizer state") as err:
        other.load_checkpoint(tmp_path)
    assert "differs from the one that was saved" in str(err.value)
    other.close()


def test_a_checkpoint_saved_before_the_first_step_leaves_the_optimizer_untouched(tmp_path: Path) -> None:
    """torch would give a fresh optimizer state by stepping it once with zero gradients."""
    e = engine()
    e.save_checkpoint(tmp_path)
    assert not e.optimizer.state
    e.load_checkpoint(tmp_path)
    assert not e.optimizer.state
    e.close()
