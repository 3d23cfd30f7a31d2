"""ZeRO-1 on the DDP backend (torch's ZeroRedundancyOptimizer) on 2 real gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import spikingsail
from spikingsail.environments import RankInfo
from spikingsail.errors import ConfigError
from tests.backends.test_fsdp import MICRO_STEPS, data, model
from tests.multiprocess import run_ranks, train_micro_steps

pytestmark = pytest.mark.multiprocess


def config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage},
        "sail": {"backend": "ddp", "seed": 4, "progress_bar": False},
    }


def train(stage: int, checkpoints: str | None = None, stop_at: int | None = None,
          resume: bool = False) -> dict[str, Any] | None:  # fmt: skip
    net = model()
    optimizer = torch.optim.AdamW(
        [{"params": net[0].parameters(), "lr": 0.02}, {"params": net[2].parameters()}], lr=0.01
    )
    engine, optimizer = spikingsail.initialize(model=net, optimizer=optimizer, config=config(stage),
                                               checkpoints_path=checkpoints, resume=resume)  # fmt: skip
    loader = engine.dataloader(data())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()

    if not train_micro_steps(engine, loader, MICRO_STEPS, step, stop_at=stop_at, checkpoints=checkpoints):
        return None
    local = getattr(optimizer, "optim", optimizer)
    result = {"params": {k: v.detach().clone() for k, v in engine.module.named_parameters()},
              "kind": type(optimizer).__name__, "state_here": len(local.state),
              "lrs": engine.get_lr()}  # fmt: skip
    engine.close()
    return result


@pytest.fixture(scope="module")
def plain() -> dict[int, Any]:
    return run_ranks(train, 2, 0)


def test_stage_1_shards_the_optimizer_state_and_trains_like_plain_ddp(plain: dict[int, Any]) -> None:
    zero = run_ranks(train, 2, 1)
    # the 4 parameter tensors: each rank keeps Adam state for its share only
    assert zero[0]["state_here"] + zero[1]["state_here"] == plain[0]["state_here"] == 4
    assert 0 < zero[0]["state_here"] < 4
    for rank in (0, 1):
        assert zero[rank]["kind"] == "ZeroRedundancyOptimizer"
        assert zero[rank]["lrs"] == plain[rank]["lrs"] == [0.02, 0.01]  # the groups carried over
        for key, value in plain[rank]["params"].items():
            # the same AdamW update on the same all-reduced gradients, computed by one rank and
            # broadcast: bit for bit
            assert torch.equal(zero[rank]["params"][key], value), key


@pytest.mark.parametrize(("first", "then"), [(1, 1), (1, 0), (0, 1)])
def test_stage_1_checkpoints_resume_exactly_with_or_without_sharding(
    plain: dict[int, Any], tmp_path: Path, first: int, then: int
) -> None:
    straight = plain
    assert run_ranks(train, 2, first, str(tmp_path), 6) == {0: None, 1: None}
    resumed = run_ranks(train, 2, then, str(tmp_path), None, True)
    for rank in (0, 1):
        for key, value in straight[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][key], value), key


@pytest.mark.parametrize("stage", [2, 3])
def test_stages_ddp_cannot_shard_are_refused_naming_the_backends_that_can(stage: int) -> None:
    net = model()
    with pytest.raises(ConfigError, match=rf"stage is {stage}, which backend ddp does not implement") as err:
        spikingsail.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                               config=config(stage), rank_info=RankInfo.single())  # fmt: skip
    assert "one of: deepspeed, fsdp" in str(err.value)
