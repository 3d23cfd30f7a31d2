"""The engine in one process: no process group, DeepSpeed's step bookkeeping, optimizer from config."""

from __future__ import annotations

import logging
import re
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import spikingsail
from spikingsail.environments import RankInfo
from spikingsail.errors import ConfigError

SINGLE = RankInfo.single()


def engine_for(config: dict[str, Any], **kwargs: Any) -> spikingsail.Engine:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    base = {"train_micro_batch_size_per_gpu": 2, "sail": {"progress_bar": False}}
    engine, _ = spikingsail.initialize(model=model, config={**base, **config}, rank_info=SINGLE, **kwargs)
    return engine


def micro_step(engine: spikingsail.Engine) -> None:
    x, y = torch.randn(2, 4), torch.tensor([0, 1])
    engine.backward(F.cross_entropy(engine(x), y))
    engine.step()


def test_world_size_one_needs_no_process_group() -> None:
    engine = engine_for({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    micro_step(engine)
    assert not dist.is_initialized()
    assert engine.wrapped_module is engine.module
    assert (engine.rank, engine.world_size, engine.device.type) == (0, 1, "cpu")
    engine.close()


def test_accumulation_boundaries_and_counters() -> None:
    engine = engine_for(
        {
            "gradient_accumulation_steps": 3,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "scheduler": {
                "type": "WarmupLR",
                "params": {
                    "warmup_min_lr": 0.01,
                    "warmup_max_lr": 0.11,
                    "warmup_num_steps": 10,
                    "warmup_type": "linear",
                },
            },
        }
    )
    weight = engine.module.weight
    boundaries, steps, lrs = [], [], []
    for _ in range(6):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        before = weight.detach().clone()
        micro_step(engine)
        steps.append(engine.global_steps)
        lrs.append(engine.get_lr()[0])
        changed = not torch.equal(before, weight)
        assert changed == boundaries[-1], "weights may change only on a boundary"
        assert (weight.grad is None) == boundaries[-1], "gradients accumulate until the boundary"
    assert boundaries == [False, False, True, False, False, True]
    assert steps == [0, 0, 1, 1, 1, 2]
    assert engine.micro_steps == 6 and engine.global_samples == 12
    assert lrs == pytest.approx([0.01, 0.01, 0.01, 0.01, 0.01, 0.02])  # the schedule moves per optimizer step
    engine.close()


def test_adam_from_config_means_adamw_without_decay() -> None:
    engine = engine_for({"optimizer": {"type": "Adam", "params": {"lr": 0.01}}})
    assert type(engine.optimizer) is torch.optim.AdamW
    assert engine.optimizer.param_groups[0]["weight_decay"] == 0.0
    engine.close()
    engine = engine_for({"optimizer": {"type": "Adam", "params": {"lr": 0.01, "adam_w_mode": False}}})
    assert type(engine.optimizer) is torch.optim.Adam
    engine.close()


def test_client_optimizer_wins_over_config(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    client = torch.optim.SGD(model.parameters(), lr=0.5)
    with caplog.at_level(logging.INFO):
        engine, optimizer = spikingsail.initialize(
            model=model,
            optimizer=client,
            rank_info=SINGLE,
            config={"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1}}},
        )
    assert optimizer is client
    assert "the config's optimizer section (AdamW) is ignored" in caplog.text
    assert (
        "optimizer               : SGD, passed to the engine (the config's AdamW is ignored)" in caplog.text
    )
    engine.close()


def test_client_scheduler_wins_over_config_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Linear(4, 2)
    client = torch.optim.SGD(model.parameters(), lr=0.5)
    schedule = torch.optim.lr_scheduler.StepLR(client, step_size=1, gamma=0.5)
    config = {"train_micro_batch_size_per_gpu": 2, "scheduler": {"type": "WarmupLR", "params": {}}}
    with caplog.at_level(logging.INFO):
        engine, _ = spikingsail.initialize(
            model=model, optimizer=client, lr_scheduler=schedule, rank_info=SINGLE, config=config
        )
    assert engine.lr_scheduler is schedule
    assert (
        "the lr_scheduler passed to the engine (StepLR) is used; the config's scheduler section (WarmupLR) is ignored"
        in caplog.text
    )
    assert (
        "scheduler               : StepLR, passed to the engine (the config's WarmupLR is ignored)"
        in caplog.text
    )
    assert "optimizer               : SGD, passed to the engine\n" in caplog.text
    engine.close()


def test_no_optimizer_anywhere_is_a_clear_error() -> None:
    with pytest.raises(spikingsail.ConfigError, match="no optimizer"):
        engine_for({})


def test_fp16_trains_on_cpu_and_skips_overflowing_steps() -> None:
    engine = engine_for(
        {
            "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        }
    )
    micro_step(engine)
    assert engine.loss_scale == 256 and engine.skipped_steps == 0
    before = engine.module.weight.detach().clone()
    loss = engine(torch.randn(2, 4)).sum() * float("inf")
    engine.backward(loss)
    engine.step()
    assert engine.skipped_steps == 1 and engine.loss_scale == 128
    assert torch.equal(before, engine.module.weight), "an overflowing step must not touch the weights"
    assert engine.global_steps == 2
    engine.close()


def test_metrics_file_gets_one_line_per_step(tmp_path: Any) -> None:
    import json

    path = tmp_path / "m.jsonl"
    engine = engine_for(
        {
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "sail": {"progress_bar": False, "metrics_path": str(path)},
        }
    )
    for _ in range(3):
        micro_step(engine)
    engine.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(isinstance(r["loss"], float) and r["samples"] == 2 * r["step"] for r in records)


def test_inputs_are_moved_through_nested_structures() -> None:
    from spikingsail.tensors import map_tensors

    moved = map_tensors(({"x": [torch.ones(1)], "n": 3}, (torch.zeros(2),)), lambda t: t.to("meta"))
    assert moved[0]["n"] == 3
    assert moved[0]["x"][0].device.type == "meta" and moved[1][0].device.type == "meta"


SGD = {"type": "SGD", "params": {"lr": 0.1}}


def test_balance_by_host_names_a_host_without_a_weight() -> None:
    host = socket.gethostname()
    with pytest.raises(ConfigError, match=rf"sail\.balance has no weight for host\(s\) {re.escape(host)}"):
        engine_for({"optimizer": SGD, "sail": {"progress_bar": False, "balance": {"elsewhere": 1}}})
    engine = engine_for(
        {"optimizer": SGD, "sail": {"progress_bar": False, "balance": {host: 2, "elsewhere": 1}}}
    )
    assert engine.balancer is not None and engine.balancer.split == [engine.train_micro_batch_size_per_gpu()]
    engine.close()


def test_balance_refuses_a_loss_not_from_the_engines_loader() -> None:
    engine = engine_for({"optimizer": SGD, "sail": {"progress_bar": False, "balance": [1]}})
    loss = F.mse_loss(engine(torch.randn(2, 4)), torch.zeros(2, 2))
    with pytest.raises(ConfigError, match=r"this loss does not come from a batch of engine\.dataloader"):
        engine.backward(loss)
    engine.close()
