"""Exact resume: stopping mid-epoch and mid-accumulation, then resuming, changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.environments import RankInfo
from spikingsail.errors import CheckpointError
from tests.multiprocess import run_ranks

TOTAL_MICRO_STEPS = 21  # 64 samples / (micro 4 × W ranks) per epoch: several epochs, ends mid-window


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))


def config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 5,
                                                     "warmup_type": "linear"}},
        "gradient_clipping": 1.0,
        "sail": {"seed": 11, "progress_bar": False},
    }  # fmt: skip


def train(
    checkpoints: str | None, stop_at: int | None, resume: bool, single: bool, background: bool = False
) -> dict[str, Any] | None:
    """Train to TOTAL_MICRO_STEPS, or save at micro-step ``stop_at`` and stop there.

    With ``background`` the save is asynchronous and training goes on for three more micro-steps
    (changing every parameter) while it is written; the checkpoint must still hold step ``stop_at``.
    """
    stop_after = None if stop_at is None else stop_at + (3 if background else 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    engine, _ = spikingsail.initialize(
        model=model, config=config(), rank_info=RankInfo.single() if single else None,
        checkpoints_path=checkpoints, resume=resume,
    )  # fmt: skip
    loader = engine.dataloader(dataset())
    while engine.micro_steps < TOTAL_MICRO_STEPS:
        for x, y in loader:
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
            if engine.micro_steps == stop_at:
                assert checkpoints is not None
                engine.save_checkpoint(
                    checkpoints, client_state={"note": "stopped", "at": stop_at}, async_save=background
                )
            if engine.micro_steps == stop_after:
                engine.close()  # waits for a background save
                return None
            if engine.micro_steps == TOTAL_MICRO_STEPS:
                break
    result = {
        "model": {k: v.clone() for k, v in engine.module.state_dict().items()},
        "optimizer": engine.optimizer.state_dict(),
        "steps": (engine.global_steps, engine.micro_steps, loader.epoch, loader.position),
        "rng": torch.get_rng_state(),
    }
    engine.close()
    return result


def assert_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["steps"] == b["steps"]
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    state_a, state_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        for name, value in state_a[index].items():
            assert torch.equal(value, state_b[index][name]), (index, name)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert torch.equal(a["rng"], b["rng"])


@pytest.mark.parametrize("stop_at", [7, 12])  # 7: mid-window (accumulation 2) and mid-epoch; 12: mid-epoch
def test_one_process_resume_is_bit_exact(tmp_path: Path, stop_at: int) -> None:
    straight = train(None, None, resume=False, single=True)
    assert train(str(tmp_path), stop_at, resume=False, single=True) is None
    resumed = train(str(tmp_path), None, resume=True, single=True)
    assert straight is not None and resumed is not None
    assert_identical(straight, resumed)


def test_async_save_holds_the_step_it_was_taken_at(tmp_path: Path) -> None:
    straight = train(None, None, resume=False, single=True)
    assert train(str(tmp_path), 7, resume=False, single=True, background=True) is None
    resumed = train(str(tmp_path), None, resume=True, single=True)
    assert straight is not None and resumed is not None
    assert_identical(straight, resumed)


def test_the_check_would_catch_a_lost_rng_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the RNG states, dropout draws differ after the resume: the comparison above can fail."""
    from spikingsail.checkpoint import engine_state

    straight = train(None, None, resume=False, single=True)
    assert train(str(tmp_path), 7, resume=False, single=True) is None
    monkeypatch.setattr(engine_state, "restore_rng", lambda state, device: None)
    resumed = train(str(tmp_path), None, resume=True, single=True)
    assert straight is not None and resumed is not None
    with pytest.raises(AssertionError):
        assert_identical(straight, resumed)


@pytest.mark.multiprocess
def test_two_process_resume_is_bit_exact(tmp_path: Path) -> None:
    straight = run_ranks(train, 2, None, None, False, False)
    assert run_ranks(train, 2, str(tmp_path), 7, False, False) == {0: None, 1: None}
    resumed = run_ranks(train, 2, str(tmp_path), None, True, False)
    for rank in (0, 1):
        assert_identical(straight[rank], resumed[rank])


@pytest.mark.multiprocess
def test_two_process_async_save_resume_is_bit_exact(tmp_path: Path) -> None:
    straight = run_ranks(train, 2, None, None, False, False)
    assert run_ranks(train, 2, str(tmp_path), 7, False, False, True) == {0: None, 1: None}
    resumed = run_ranks(train, 2, str(tmp_path), None, True, False)
    for rank in (0, 1):
        assert_identical(straight[rank], resumed[rank])


def test_resume_without_a_checkpoint_starts_fresh(tmp_path: Path) -> None:
    straight = train(None, None, resume=False, single=True)
    fresh = train(str(tmp_path / "empty"), None, resume=True, single=True)
    assert straight is not None and fresh is not None
    assert_identical(straight, fresh)


def test_resume_needs_a_path() -> None:
    with pytest.raises(spikingsail.ConfigError, match="--resume needs to know where the checkpoints are"):
        spikingsail.initialize(model=torch.nn.Linear(2, 2), config=config(), rank_info=RankInfo.single(),
                               resume=True)  # fmt: skip


def saved_at_step(tmp_path: Path, micro_steps: int = 4) -> Path:
    """A single-process run of ``config()`` saved after ``micro_steps`` micro-steps."""
    torch.manual_seed(0)
    engine, _ = spikingsail.initialize(
        model=torch.nn.Linear(6, 3), config=config(), rank_info=RankInfo.single()
    )
    for x, y in engine.dataloader(dataset()):
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
        if engine.micro_steps == micro_steps:
            break
    engine.save_checkpoint(tmp_path)
    engine.close()
    return tmp_path


def resume_with(checkpoints: Path, changed: dict[str, Any]) -> spikingsail.Engine:
    torch.manual_seed(0)
    engine, _ = spikingsail.initialize(model=torch.nn.Linear(6, 3), config={**config(), **changed},
                                       rank_info=RankInfo.single(), checkpoints_path=str(checkpoints),
                                       resume=True)  # fmt: skip
    return engine


@pytest.mark.parametrize(
    ("changed", "named"),
    [
        ({"optimizer": {"type": "AdamW", "params": {"lr": 0.5, "weight_decay": 0.01}}},
         'optimizer.params.lr: saved 0.01, now 0.5'),
        ({"gradient_clipping": 2.0}, "gradient_clipping: saved 1.0, now 2.0"),
        ({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2},
         "train_batch_size: saved 8, now 16"),
        ({"scheduler": None}, 'scheduler: saved {"type": "WarmupLR"'),
        ({"bf16": {"enabled": True}}, "bf16.enabled: saved false, now true"),
        ({"sail": {"seed": 12, "progress_bar": False}}, "sail.seed: saved 11, now 12"),
    ],
)  # fmt: skip
def test_a_resume_with_a_changed_training_setting_is_refused_naming_both_values(
    tmp_path: Path, changed: dict[str, Any], named: str
) -> None:
    checkpoints = saved_at_step(tmp_path)
    if changed.get("scheduler", "") is None:
        changed = {}
        cfg = config()
        del cfg["scheduler"]
        with pytest.raises(CheckpointError) as refused:
            spikingsail.initialize(model=torch.nn.Linear(6, 3), config=cfg, rank_info=RankInfo.single(),
                                   checkpoints_path=str(checkpoints), resume=True)  # fmt: skip
    else:
        with pytest.raises(CheckpointError) as refused:
            resume_with(checkpoints, changed)
    message = str(refused.value)
    assert "cannot be resumed with this config" in message and named in message, message
    assert "load_module_only=True" in message
    # a changed global batch (the usual cause: a resume on fewer processes with the micro-batch set)
    assert ('put "train_batch_size": 8 in the config' in message) == named.startswith("train_batch_size")


def test_where_and_how_a_run_is_kept_may_change_on_resume(tmp_path: Path) -> None:
    checkpoints = saved_at_step(tmp_path)
    engine = resume_with(checkpoints, {"checkpoint": {"keep_last": 2, "interval_steps": 3}, "steps_per_print": 1,
                                       "sail": {"seed": 11, "progress_bar": False, "timeout_minutes": 5}})  # fmt: skip
    assert engine.global_steps == 2
    engine.close()


def test_a_split_change_inside_an_accumulation_window_is_refused(tmp_path: Path) -> None:
    checkpoints = saved_at_step(tmp_path, micro_steps=5)  # inside a window of 2
    with pytest.raises(CheckpointError, match=r"(?s)inside a gradient accumulation window.*"
                       r"gradient_accumulation_steps: saved 2, now 1"):  # fmt: skip
        resume_with(checkpoints, {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                                  "train_batch_size": 8})  # fmt: skip


def test_a_backend_change_inside_an_accumulation_window_is_refused(tmp_path: Path) -> None:
    # the window's partial gradients are plain tensors; fsdp would step them as its sharded ones
    checkpoints = saved_at_step(tmp_path, micro_steps=5)  # inside a window of 2
    with pytest.raises(CheckpointError, match=r"(?s)inside a gradient accumulation window.*"
                       r'sail.backend: saved "ddp", now "fsdp".*resume with the saved split and backend'):  # fmt: skip
        resume_with(checkpoints, {"sail": {"backend": "fsdp", "seed": 11, "progress_bar": False}})
    on_a_boundary = saved_at_step(tmp_path / "boundary", micro_steps=4)
    engine = resume_with(on_a_boundary, {"sail": {"backend": "fsdp", "seed": 11, "progress_bar": False}})
    assert engine.micro_steps == 4
    engine.close()


def test_load_module_only_starts_a_new_run_from_the_saved_weights(tmp_path: Path) -> None:
    checkpoints = saved_at_step(tmp_path)
    reference = resume_with(checkpoints, {})
    weights = {k: v.clone() for k, v in reference.module.state_dict().items()}
    reference.close()
    torch.manual_seed(0)
    engine, _ = spikingsail.initialize(model=torch.nn.Linear(6, 3), config={**config(), "gradient_clipping": 3.0},
                                       rank_info=RankInfo.single())  # fmt: skip
    engine.load_checkpoint(checkpoints, load_module_only=True)
    assert (engine.global_steps, engine.micro_steps) == (0, 0)
    for key, value in weights.items():
        assert torch.equal(engine.module.state_dict()[key], value), key
    engine.close()
