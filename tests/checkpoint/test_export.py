"""The trained model out: ``engine.save_model`` on 2 real gloo ranks and ``sail checkpoint export``
offline give the live model's tensors, whatever backend trained it (DDP, ZeRO-1 on DDP, FSDP2,
DeepSpeed ZeRO-3); ``ls`` and ``verify`` describe the checkpoints; damage is refused clearly."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import spikingsail
from spikingsail.checkpoint.export import read_saved_model
from spikingsail.cli.main import main
from spikingsail.errors import CheckpointError, SailError
from tests.backends.test_fsdp import data
from tests.multiprocess import run_ranks

MICRO_STEPS = 8


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    # a buffer too (the running statistics), and a tied pair of names is not needed: plain layers
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))  # fmt: skip


def config(backend: str, stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "sail": {"backend": backend, "seed": 4, "progress_bar": False},
    }


def live_state(engine: spikingsail.Engine) -> dict[str, torch.Tensor]:
    """The model as the test reads it, independently of save_model: FSDP through torch's full state
    dict, ZeRO-3 by gathering its partitions."""
    if engine.backend.name == "fsdp":
        return dict(get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True)))
    gather: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if engine.backend.name == "deepspeed" and engine.config.zero_optimization.stage == 3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(engine.module.parameters()))
    with gather:
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def train_and_save(backend: str, stage: int, out: str) -> dict[str, Any]:
    engine, _ = spikingsail.initialize(model=model(), config=config(backend, stage))
    loader = engine.dataloader(data())
    while engine.micro_steps < MICRO_STEPS:
        for x, y in loader:
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
    engine.save_checkpoint(f"{out}/checkpoints")
    written = [engine.save_model(f"{out}/model.safetensors"), engine.save_model(f"{out}/model.pt"),
               engine.save_model(f"{out}/model-bf16.safetensors", dtype=torch.bfloat16)]  # fmt: skip
    state = {k: v.cpu() for k, v in live_state(engine).items()}
    engine.close()
    return {"state": state, "written": written}


CASES = [("ddp", 0), ("ddp", 1), ("fsdp", 0), ("deepspeed", 3)]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("backend", "stage"), CASES, ids=[f"{b}-zero{s}" for b, s in CASES])
def test_save_model_and_export_give_the_live_models_tensors(tmp_path: Path, backend: str, stage: int,
                                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    ranks = run_ranks(train_and_save, 2, backend, stage, str(tmp_path))
    live = ranks[0]["state"]
    assert ranks[0]["written"] == [
        str(tmp_path / n) for n in ("model.safetensors", "model.pt", "model-bf16.safetensors")
    ]
    assert ranks[1]["written"] == [None, None, None]  # rank 0 writes
    assert "1.running_mean" in live and live["0.weight"].shape == (16, 6)

    # BatchNorm's running statistics are each rank's own under DDP (DDP broadcasts rank 0's before
    # every forward, then each rank updates them with its own batch): save_model takes rank 0's, as
    # seed 003's rank-0 save does; a checkpoint holds the one rank's that DCP chose to write.
    other = ranks[1]["state"]

    def same(path: Path, dtype: torch.dtype = torch.float32, *, any_rank_buffers: bool = False) -> None:
        saved = read_saved_model(path)
        assert sorted(saved) == sorted(live), path
        for key, value in live.items():
            candidates = [value, other[key]] if any_rank_buffers and "running" in key else [value]
            expected = [v.to(dtype) if v.is_floating_point() else v for v in candidates]
            assert saved[key].dtype == expected[0].dtype, key
            assert any(torch.equal(saved[key], e) for e in expected), f"{path}: {key}"

    same(tmp_path / "model.safetensors")
    same(tmp_path / "model.pt")
    same(tmp_path / "model-bf16.safetensors", torch.bfloat16)
    # offline, from the checkpoint, in this process: no process group
    checkpoints = tmp_path / "checkpoints"
    assert (
        main(["checkpoint", "export", str(checkpoints), "--out", str(tmp_path / "exported.safetensors")]) == 0
    )
    assert "global_step4 (step 4" in capsys.readouterr().out
    same(tmp_path / "exported.safetensors", any_rank_buffers=True)
    assert main(["checkpoint", "export", str(checkpoints), "--tag", "global_step4",
                 "--out", str(tmp_path / "exported.pt"), "--dtype", "bfloat16"]) == 0  # fmt: skip
    same(tmp_path / "exported.pt", torch.bfloat16, any_rank_buffers=True)
    # what seed 003 does with the file: load it into the plain model, no SpikingSail
    fresh = model()
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    assert torch.equal(fresh[3].weight, live["3.weight"])
    assert main(["checkpoint", "ls", str(checkpoints)]) == 0
    listing = capsys.readouterr().out
    assert "global_step4 *" in listing and backend in listing and " 2 " in listing


def _one_run(tmp_path: Path) -> Path:
    engine, _ = spikingsail.initialize(model=model(), config=config("ddp", 0))
    for x, y in engine.dataloader(data()):
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
    engine.save_checkpoint(tmp_path / "ck")
    engine.save_checkpoint(tmp_path / "ck")  # global_step8 twice: the same tag replaced
    # one process, no process group: the module's own state dict
    assert engine.save_model(tmp_path / "one.safetensors") == str(tmp_path / "one.safetensors")
    saved = read_saved_model(tmp_path / "one.safetensors")
    live = engine.module.state_dict()
    assert sorted(saved) == sorted(live) and all(torch.equal(saved[k], live[k]) for k in live)
    with pytest.raises(CheckpointError, match=r"cannot tell the format of .*model\.onnx"):
        engine.save_model(tmp_path / "model.onnx")
    with pytest.raises(CheckpointError, match=r"no/such/dir is not a directory"):
        engine.save_model(tmp_path / "no" / "such" / "dir" / "model.pt")
    with pytest.raises(SailError, match=r"dtype=torch\.int64"):
        engine.save_model(tmp_path / "model.pt", dtype=torch.int64)
    engine.close()
    return tmp_path / "ck"


def test_a_damaged_checkpoint_is_refused_by_verify_and_export(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    checkpoints = _one_run(tmp_path)
    assert main(["checkpoint", "verify", str(checkpoints)]) == 0
    assert "global_step8: ok" in capsys.readouterr().out
    shard = sorted((checkpoints / "global_step8" / "state").glob("*.distcp"))[0]
    data_bytes = bytearray(shard.read_bytes())
    data_bytes[len(data_bytes) // 2] ^= 0xFF
    shard.write_bytes(bytes(data_bytes))
    assert main(["checkpoint", "verify", str(checkpoints)]) == 1
    out = capsys.readouterr()
    assert f"global_step8: BAD: {shard} is corrupt" in out.out and "failed verification" in out.err
    assert main(["checkpoint", "export", str(checkpoints), "--tag", "global_step8",
                 "--out", str(tmp_path / "m.safetensors")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "is corrupt: its SHA-256 differs" in err and "fix:" in err
    assert not (tmp_path / "m.safetensors").exists()
    assert not list(tmp_path.glob(".m.safetensors*"))  # nothing half-written
    # no checkpoint at all, a directory that is not one
    assert main(["checkpoint", "export", str(tmp_path / "none"), "--out", str(tmp_path / "m.pt")]) == 2
    assert "no loadable checkpoint" in capsys.readouterr().err
    assert main(["checkpoint", "export", str(checkpoints), "--out", str(tmp_path / "m.h5")]) == 2
    assert "cannot tell the format" in capsys.readouterr().err
