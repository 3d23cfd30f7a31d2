"""The FSDP2 backend on 2 real gloo ranks: same training as DDP, sharded state, exact resume."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.environments import RankInfo
from spikingsail.errors import BackendError, SailError
from tests.multiprocess import run_ranks, train_micro_steps

pytestmark = pytest.mark.multiprocess
MICRO_STEPS = 12


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def config(backend: str, stage: int | None = None) -> dict[str, Any]:
    """``stage``: a ``zero_optimization.stage``; None leaves the section out."""
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "gradient_clipping": 0.5,
        "sail": {"backend": backend, "seed": 4, "progress_bar": False},
    } | ({} if stage is None else {"zero_optimization": {"stage": stage}})


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))


def train(backend: str, checkpoints: str | None = None, stop_at: int | None = None,
          resume: bool = False, stage: int | None = None) -> dict[str, Any] | None:  # fmt: skip
    engine, _ = spikingsail.initialize(model=model(), config=config(backend, stage), checkpoints_path=checkpoints,
                                       resume=resume)  # fmt: skip
    loader = engine.dataloader(data())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()

    if not train_micro_steps(engine, loader, MICRO_STEPS, step, stop_at=stop_at, checkpoints=checkpoints):
        return None
    weight = engine.module[0].weight
    local_rows = weight.to_local().shape[0] if isinstance(weight, DTensor) else weight.shape[0]
    full = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True))
    result = {"params": {k: v.clone() for k, v in full.items()}, "local_rows": local_rows,
              "steps": engine.global_steps}  # fmt: skip
    engine.close()
    return result


@pytest.mark.parametrize("stage", [None, 2])
def test_fsdp_trains_like_ddp_with_sharded_parameters(stage: int | None) -> None:
    ddp = run_ranks(train, 2, "ddp")
    fsdp = run_ranks(train, 2, "fsdp", None, None, False, stage)
    assert fsdp[0]["local_rows"] == fsdp[1]["local_rows"] == 16  # each rank holds half of the 32 rows
    assert ddp[0]["local_rows"] == 32
    for rank in (0, 1):
        assert fsdp[rank]["steps"] == ddp[rank]["steps"] == MICRO_STEPS // 2
        for key, value in ddp[rank]["params"].items():
            # reduce-scatter and all-reduce add the two ranks' gradients in different orders
            torch.testing.assert_close(fsdp[rank]["params"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_fsdp_resume_is_exact(tmp_path: Path) -> None:
    straight = run_ranks(train, 2, "fsdp")
    assert run_ranks(train, 2, "fsdp", str(tmp_path), 6) == {0: None, 1: None}
    # each rank writes its own shards (one file each: DCP's writer runs in the saving thread)
    assert sorted(p.name for p in (tmp_path / "global_step3" / "state").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]  # fmt: skip
    resumed = run_ranks(train, 2, "fsdp", str(tmp_path), None, True)
    for rank in (0, 1):
        for key, value in straight[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][key], value), key


def between_forward_and_backward(stage: int | None) -> dict[str, Any]:
    """Whether a unit's parameter is sharded between its forward and the backward, with the
    config's ZeRO stage."""
    engine, _ = spikingsail.initialize(model=model(), config=config("fsdp", stage))
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    loss = F.cross_entropy(engine(x), y)
    sharded = isinstance(engine.module[0].weight, DTensor)
    engine.backward(loss)
    engine.step()
    engine.close()
    return {"sharded": sharded}


def every_stage(stages: list[int | None]) -> dict[int | None, bool]:
    """``between_forward_and_backward`` for each stage, one engine after another in one group."""
    dist.init_process_group("gloo")  # the engines join it, and leave it up for the next one
    try:
        return {stage: between_forward_and_backward(stage)["sharded"] for stage in stages}
    finally:
        dist.destroy_process_group()


def test_zero_stages_1_and_2_keep_parameters_gathered_from_forward_to_backward() -> None:
    stages = [None, 0, 1, 2, 3]
    for rank, seen in run_ranks(every_stage, 2, stages).items():
        assert seen == {None: True, 0: True, 1: False, 2: False, 3: True}, f"rank {rank}: sharded by stage"


def test_an_optimizer_that_has_stepped_is_refused() -> None:
    net = model()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.ones(1, 6)).sum().backward()
    optimizer.step()
    with pytest.raises(BackendError, match="has already stepped"):
        spikingsail.initialize(model=net, optimizer=optimizer, rank_info=RankInfo.single(),
                               config={"train_micro_batch_size_per_gpu": 1, "sail": {"backend": "fsdp"}})  # fmt: skip


def bf16_dtypes() -> dict[str, str]:
    cfg = {**config("fsdp"), "bf16": {"enabled": True}}
    engine, _ = spikingsail.initialize(model=model(), config=cfg)
    seen: dict[str, str] = {}
    first = engine.module[0]

    def hook(module: torch.nn.Module, _args: Any) -> None:
        seen.setdefault("in_forward", str(module.weight.dtype))

    first.register_forward_pre_hook(hook)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    engine.backward(F.cross_entropy(engine(x).float(), y))
    engine.step()
    seen["stored"] = str(first.weight.dtype)
    engine.close()
    return seen


def test_bf16_gathers_parameters_in_bfloat16_and_keeps_float32_shards() -> None:
    for seen in run_ranks(bf16_dtypes, 2).values():
        assert seen == {"in_forward": "torch.bfloat16", "stored": "torch.float32"}


@pytest.mark.parametrize(("first", "then"), [("ddp", "fsdp"), ("fsdp", "ddp")])
def test_a_checkpoint_resumes_under_the_other_backend(tmp_path: Path, first: str, then: str) -> None:
    straight = run_ranks(train, 2, "ddp")
    assert run_ranks(train, 2, first, str(tmp_path), 6) == {0: None, 1: None}
    resumed = run_ranks(train, 2, then, str(tmp_path), None, True)
    for rank in (0, 1):
        assert resumed[rank]["local_rows"] == (16 if then == "fsdp" else 32)
        for key, value in straight[rank]["params"].items():
            torch.testing.assert_close(resumed[rank]["params"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def gloo_threads(backend: str, stage: int | None) -> tuple[list[str], list[str]]:
    """Names of this process's gloo threads while the engine trains, and those left after close().

    A thread that close() has just joined can still be listed for a moment: ``pthread_join`` returns
    part-way through the thread's exit, and the thread leaves ``/proc/self/task`` at its end, later
    still where the joining thread has preempted it on a busy core. The threads of a group that
    something still holds are there for good: those left after 10 s."""

    def names() -> list[str]:
        found = []
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # ended since the listing
                if "gloo" in (name := (task / "comm").read_text().strip()):
                    found.append(name)
        return sorted(found)

    net = model()
    engine, _ = spikingsail.initialize(model=net, config=config(backend, stage))
    x, y = data().tensors
    for rows in (slice(0, 4), slice(4, 8)):  # one optimizer step: ZeRO-1 broadcasts in it
        engine.backward(F.cross_entropy(engine(x[rows]), y[rows]))
        engine.step()
    training = names()
    engine.close()
    # net stays alive, as in a script that keeps its model after training
    deadline = time.monotonic() + 10
    while (left := names()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return training, left


@pytest.mark.parametrize(
    ("backend", "stage"), [("ddp", None), ("ddp", 1), ("fsdp", None), ("deepspeed", 1), ("deepspeed", 2)]
)
def test_close_ends_gloos_threads_while_the_model_lives_on(backend: str, stage: int | None) -> None:
    # Threads of a destroyed group that live on are joined at interpreter shutdown, where they can
    # crash the process (SIGSEGV / SIGABRT at exit, pytorch/pytorch#190489). Anything that keeps
    # the group (DDP's reducer, ZeRO-1's optimizer) must let it go at close().
    for training, closed in run_ranks(gloo_threads, 2, backend, stage).values():
        assert "pt_gloo_runloop" in training and closed == [], (training, closed)


def save_mid_window(tmp: str) -> str:
    engine, _ = spikingsail.initialize(model=model(), config=config("fsdp"))
    x, y = data()[:4]
    engine.backward(F.cross_entropy(engine(x), y))
    engine.step()  # micro-step 1 of a window of 2
    try:
        engine.save_checkpoint(tmp)
        message = "no error"
    except SailError as err:
        message = f"{type(err).__name__}: {err}"
    engine.close()
    return message + f" | written: {sorted(p.name for p in Path(tmp).rglob('*'))}"


def test_a_save_inside_an_accumulation_window_is_refused_before_writing(tmp_path: Path) -> None:
    for message in run_ranks(save_mid_window, 2, str(tmp_path / "ckpt")).values():
        assert message.startswith(
            "CheckpointError: cannot save inside a gradient accumulation window with the fsdp"
        )
        assert "save after engine.step() on an accumulation boundary" in message
        assert message.endswith("| written: []")


def batch_norm_run(backend: str, checkpoints: str, stop: bool, resume: bool) -> dict[str, Any] | None:
    """A model with a batch norm of its own on each rank (no SyncBatchNorm): 12 micro-steps, saved
    at the sixth; ``stop`` ends the run there, ``resume`` continues from that checkpoint. Returns the
    rank's own parameters and buffers."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(6, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(), torch.nn.Linear(32, 3)
    )
    engine, _ = spikingsail.initialize(
        model=net, config=config(backend), checkpoints_path=checkpoints, resume=resume
    )
    loader = engine.dataloader(data())
    while engine.micro_steps < MICRO_STEPS:
        for x, y in loader:
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
            if engine.micro_steps == 6:
                engine.save_checkpoint(checkpoints)
                if stop:
                    engine.close()
                    return None
            if engine.micro_steps == MICRO_STEPS:
                break
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
             for k, v in engine.module.state_dict().items()}  # fmt: skip
    engine.close()
    return state


@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_a_resume_with_per_rank_batch_norm_statistics_equals_the_run_that_saved(
    tmp_path: Path, backend: str
) -> None:
    straight = run_ranks(batch_norm_run, 2, backend, str(tmp_path / "straight"), False, False)
    assert run_ranks(batch_norm_run, 2, backend, str(tmp_path / "stopped"), True, False) == {0: None, 1: None}
    resumed = run_ranks(batch_norm_run, 2, backend, str(tmp_path / "stopped"), False, True)
    running = [name for name in straight[0] if "running_" in name]
    assert running == ["1.running_mean", "1.running_var"]
    # each rank's batch norm sees its own batches: the ranks' statistics differ, so the test would
    # see a checkpoint that gives every rank another rank's
    assert not torch.equal(straight[0]["1.running_mean"], straight[1]["1.running_mean"])
    for rank in (0, 1):
        for name, value in straight[rank].items():
            assert torch.equal(resumed[rank][name], value), f"rank {rank}: {name}"


def from_unseeded_model(backend: str) -> dict[str, torch.Tensor]:
    """Each rank builds the model from its own seed (as a script that sets none before building it
    does); returns the whole model after 6 micro-steps."""
    torch.manual_seed(100 + int(os.environ["RANK"]))
    net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    engine, _ = spikingsail.initialize(model=net, config=config(backend))
    state = after_six_micro_steps(engine)
    engine.close()
    return state


def after_six_micro_steps(engine: Any) -> dict[str, torch.Tensor]:
    """The whole model after 6 micro-steps on ``data()``."""
    loader = engine.dataloader(data())
    train_micro_steps(
        engine, loader, 6, lambda x, y: (engine.backward(F.cross_entropy(engine(x), y)), engine.step())
    )
    full = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True))
    return {k: v.clone() for k, v in full.items()}


def test_ranks_that_built_different_weights_start_from_rank_0s_as_under_ddp() -> None:
    ddp = run_ranks(from_unseeded_model, 2, "ddp")
    fsdp = run_ranks(from_unseeded_model, 2, "fsdp")
    built = [torch.manual_seed(100 + rank) and torch.nn.Linear(6, 32).weight for rank in (0, 1)]
    assert not torch.equal(*built), "the ranks' seeds must give different weights, or the test tests nothing"
    for rank in (0, 1):
        for key, value in ddp[rank].items():
            torch.testing.assert_close(fsdp[rank][key], value, rtol=1e-5, atol=1e-6, msg=key)


def tied(backend: str) -> dict[str, Any]:
    """A model whose middle layers share one weight (tied weights, as an embedding and an output layer
    share theirs): whether the tie survives sharding, and the whole model after 6 micro-steps."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))  # fmt: skip
    net[4].weight = net[2].weight
    engine, _ = spikingsail.initialize(model=net, config=config(backend))
    result = {
        "params": after_six_micro_steps(engine),
        "still_tied": engine.module[4].weight is engine.module[2].weight,
    }
    engine.close()
    return result


def test_tied_weights_stay_tied_and_train_as_under_ddp() -> None:
    # fully_shard refuses a parameter in two units; the children that share one stay in the root's
    ddp, fsdp = run_ranks(tied, 2, "ddp"), run_ranks(tied, 2, "fsdp")
    for rank in (0, 1):
        assert fsdp[rank]["still_tied"] and ddp[rank]["still_tied"]
        for key, value in ddp[rank]["params"].items():
            torch.testing.assert_close(fsdp[rank]["params"][key], value, rtol=1e-5, atol=1e-6, msg=key)
