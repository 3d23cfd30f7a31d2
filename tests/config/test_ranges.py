"""Every numeric key has the range its consumer needs, checked when the config is loaded, and the
ends of each range work with the consumer itself (numpy's seed, torch's store, the loss scaler)."""

from __future__ import annotations

import datetime
import random
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from spikingsail.config import load_config
from spikingsail.config.schema import MAX_TIMEOUT_MINUTES
from spikingsail.engine.setup import seed_everything
from spikingsail.errors import ConfigError
from spikingsail.optim.optimizers import build_optimizer
from spikingsail.optim.schedulers import build_scheduler
from spikingsail.precision import select_precision

MICRO = {"train_micro_batch_size_per_gpu": 4}
ONE_CYCLE = {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01}


def error(config: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config({**MICRO, **config}, 1)
    return str(info.value)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"fp16": {"enabled": True, "initial_scale_power": 2000}},
         ["fp16.initial_scale_power is 2000", "above 2**127", "an integer from 0 to 127"]),
        ({"scheduler": {"type": "OneCycle", "params": {**ONE_CYCLE, "cycle_first_step_size": 0}}},
         ["scheduler.params.cycle_first_step_size is 0", "an integer ≥ 1"]),
        ({"sail": {"seed": -1}}, ["sail.seed is -1", "numpy", "an integer from 0 to 2**32-1"]),
        ({"sail": {"seed": 2**40}}, ["sail.seed is 1099511627776", "an integer from 0 to 2**32-1"]),
        ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}},
         ["optimizer.params.betas is [0.9]", "a pair (beta1, beta2)", '"betas": [0.9, 0.999]']),
        ({"gradient_clipping": float("nan")}, ["gradient_clipping is nan", "finite", "(0 = off)"]),
        ({"sail": {"timeout_minutes": 1e300}}, ["sail.timeout_minutes is 1e+300", "int64 nanoseconds"]),
        ({"sail": {"timeout_minutes": 0}}, ["sail.timeout_minutes is 0", "between 1 second and 100 years"]),
        ({"fp16": {"loss_scale": float("inf")}}, ["fp16.loss_scale is inf", "finite"]),
        ({"fp16": {"min_loss_scale": 0}}, ["fp16.min_loss_scale is 0", "a number in (0, "]),
        ({"fp16": {"hysteresis": 1.5}}, ["fp16.hysteresis is 1.5", "whole number"]),
        ({"checkpoint": {"interval_seconds": float("inf")}}, ["checkpoint.interval_seconds is inf", "0 turns it off"]),
        ({"snn": {"time_steps": 0}}, ["snn.time_steps is 0"]),
        ({"steps_per_print": 0}, ["steps_per_print is 0", "an integer ≥ 1"]),
        ({"gradient_accumulation_steps": 2**63}, ["gradient_accumulation_steps is 9223372036854775808", "int64"]),
        ({"optimizer": {"type": "AdamW", "params": {"lr": float("inf")}}}, ["optimizer.params.lr is inf"]),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1e300}}}, ["optimizer.params.lr is 1e+300", "float32"]),
        ({"optimizer": {"type": "SGD", "params": {"lr": float("nan")}}}, ["optimizer.params.lr is nan"]),
        ({"optimizer": {"type": "AdamW", "params": {"eps": 0}}}, ["optimizer.params.eps is 0", "away from zero"]),
        ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}}, ["optimizer.params.betas[1] is 1.0"]),
        ({"optimizer": {"type": "AdamW", "params": {"betas": "0.9"}}}, ["optimizer.params.betas is '0.9'"]),
        ({"optimizer": {"type": "AdamW", "params": {"amsgrad": "yes"}}}, ["optimizer.params.amsgrad is 'yes'"]),
        ({"optimizer": {"type": "AdamW", "params": {"differentiable": True}}},
         ["optimizer.params.differentiable is true", "remove"]),
        ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "nesterov": True}}},
         ["optimizer.params.nesterov is true, but optimizer.params.momentum is 0"]),
        ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": 1}}}, ["optimizer.params.adam_w_mode is 1"]),
        ({"optimizer": {"type": "Adam", "params": {"decoupled_weight_decay": True}}},
         ["'decoupled_weight_decay', which AdamW does not take", "adam_w_mode is false"]),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}},
         ["scheduler.params.warmup_type is 'cosine'", '"log" or "linear"']),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": -0.1}}},
         ["scheduler.params.warmup_max_lr is -0.1"]),
        ({"scheduler": {"type": "OneCycle", "params": {**ONE_CYCLE, "cycle_max_mom": 1.0}}},
         ["scheduler.params.cycle_max_mom is 1.0", "beta1"]),
        ({"zero_optimization": {"overlap_comm": "yes"}}, ["zero_optimization.overlap_comm is 'yes'"]),
        ({"zero_optimization": {"reduce_bucket_size": 0}}, ["zero_optimization.reduce_bucket_size is 0"]),
        ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
         ["zero_optimization.offload_optimizer.device is 'gpu'", 'set zero_optimization.offload_optimizer.device to "cpu"']),
        ({"zero_optimization": {"offload_param": {"pin_memory": True, "buffer_cnt": 4}}},
         ["unknown key 'buffer_cnt' in 'zero_optimization.offload_param'", "did you mean 'buffer_count'"]),
        ({"checkpoint": {"tag_validation": "strict"}}, ["checkpoint.tag_validation is 'strict'", "'Warn'"]),
        ({"checkpoint": {"parallel_write": {"pipeline_stage": 1}}}, ["checkpoint.parallel_write.pipeline_stage is 1"]),
        ({"checkpoint": {"path": ""}}, ["checkpoint.path is ''"]),
        ({"sail": {"metrics_path": " "}}, ["sail.metrics_path is ' '"]),
    ],
)  # fmt: skip
def test_a_value_out_of_range_names_the_key_the_value_and_the_fix(
    config: dict[str, Any], expected: list[str]
) -> None:
    message = error(config)
    for part in expected:
        assert part in message, message
    assert "fix:" in message


def test_whole_floats_count_as_integers_as_in_deepspeed() -> None:
    config = load_config(
        {"train_batch_size": 32.0, "gradient_accumulation_steps": 1e0, "sail": {"seed": 1e3},
         "fp16": {"loss_scale_window": 1e3}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1e2}}},
        4,
    )  # fmt: skip
    assert (config.train_micro_batch_size_per_gpu, config.sail.seed, config.fp16.loss_scale_window) == (
        8,
        1000,
        1000,
    )
    assert isinstance(config.sail.seed, int)


def test_the_largest_loss_scale_power_scales_a_float32_loss() -> None:
    config = load_config({**MICRO, "fp16": {"enabled": True, "initial_scale_power": 127}}, 1)
    precision = select_precision(config.fp16, config.bf16, torch.device("cpu"))
    assert precision.loss_scale == 2.0**127
    assert torch.isfinite(precision.scale_loss(torch.ones((), dtype=torch.float32))).item()


def test_the_seed_range_is_numpys() -> None:
    state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        for seed in (0, 2**32 - 1):
            seed_everything(load_config({**MICRO, "sail": {"seed": seed}}, 1).sail.seed or 0)
        with pytest.raises(ValueError, match="Seed must be between 0 and 2\\*\\*32 - 1"):
            np.random.seed(2**32)  # the bound is numpy's, one past the range's end
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.random.set_rng_state(state[2])


def test_the_longest_timeout_works_with_torchs_store_and_group() -> None:
    """100 years: the store and a gloo group of one accept it and a collective completes."""
    minutes = load_config({**MICRO, "sail": {"timeout_minutes": MAX_TIMEOUT_MINUTES}}, 1).sail.timeout_minutes
    timeout = datetime.timedelta(minutes=minutes)
    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timeout, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)
    try:
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        assert tensor.item() == 1.0
    finally:
        dist.destroy_process_group()
    assert "between 1 second and 100 years" in error(
        {"sail": {"timeout_minutes": MAX_TIMEOUT_MINUTES * 1.01}}
    )


def test_hyper_parameters_reach_torch_as_floats() -> None:
    """torch reads a Python int as int64: a whole-number lr of 2**64 must arrive as a float."""
    config = load_config(
        {**MICRO, "optimizer": {"type": "SGD", "params": {"lr": 2**64}},
         "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 2**64, "warmup_max_lr": 2**64}}},
        1,
    )  # fmt: skip
    assert config.optimizer is not None and config.scheduler is not None
    model = torch.nn.Linear(2, 1)
    optimizer = build_optimizer(config.optimizer, model.parameters(), config.source)
    scheduler = build_scheduler(config.scheduler, optimizer, config.source)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == float(2**64)


def test_capturable_on_a_cpu_model_is_refused_before_the_first_step() -> None:
    config = load_config({**MICRO, "optimizer": {"type": "AdamW", "params": {"capturable": True}}}, 1)
    assert config.optimizer is not None
    with pytest.raises(
        ConfigError, match=r"optimizer\.params\.capturable is true, but the model is on the CPU"
    ):
        build_optimizer(config.optimizer, torch.nn.Linear(2, 1).parameters(), config.source)


def test_the_scheduler_module_imports_first() -> None:
    """spikingsail.optim imports the config schema, whose package imports optim back."""
    code = "import spikingsail.optim.schedulers"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
