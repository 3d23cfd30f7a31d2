"""Config fuzzing: every key of every valid config, replaced by every kind of wrong value.

Each mutated config goes through what the engine does with a config before training, short of
starting processes: load_config, the backend's checks, the optimizer and scheduler built on a tiny
model, the precision, the seed, the timeout, and one training step as the engine takes it. Each must
either work or raise SpikingSail's own error naming the key path — never another exception, and
never accept a NaN or an infinity. The mutations are enumerated, not drawn, so a failure replays.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import math
import random
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from spikingsail.backends import backend_class, load_config
from spikingsail.backends.horovod import horovod_options
from spikingsail.engine.initialize import _check_offload, _check_zero_stage
from spikingsail.engine.setup import seed_everything
from spikingsail.errors import SailError
from spikingsail.optim.optimizers import build_optimizer
from spikingsail.optim.schedulers import build_scheduler
from spikingsail.precision import select_precision
from spikingsail.snn.support import SpikingSupport

ROOT = Path(__file__).resolve().parents[2]
NAN, INF = float("nan"), float("inf")
GARBAGE: list[Any] = [
    None, True, "", "x", [], [1, 2], {}, {"zz_garbage": 1}, [[[]]], {"zz_nested": [NAN, {"deeper": -INF}]},
    0, 1, -1, 0.5, -0.5, 2**63, 2**64, -(2**64), 1e300, -1e300, NAN, INF, -INF,
]  # fmt: skip

ONE_CYCLE = {
    "cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "decay_lr_rate": 0.1, "cycle_first_step_size": 3,
    "cycle_second_step_size": 2, "cycle_first_stair_count": 0, "cycle_second_stair_count": 1,
    "decay_step_size": 2, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
    "decay_mom_rate": 0.0, "last_batch_iteration": -1,
}  # fmt: skip
WARMUP = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5, "warmup_type": "linear"}
SCHEDULERS = [
    {"type": "OneCycle", "params": ONE_CYCLE},
    {"type": "WarmupLR", "params": {**WARMUP, "last_batch_iteration": -1}},
    {"type": "WarmupDecayLR", "params": {**WARMUP, "total_num_steps": 20, "warmup_type": "log"}},
]
ADAM_LIKE = {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "maximize": False,
             "foreach": None, "capturable": False, "differentiable": False}  # fmt: skip
OPTIMIZERS = [
    {
        "type": "Adam",
        "params": {**ADAM_LIKE, "amsgrad": False, "adam_w_mode": True, "torch_adam": True, "fused": False},
    },
    {"type": "Adam", "params": {**ADAM_LIKE, "adam_w_mode": False, "decoupled_weight_decay": False}},
    {"type": "AdamW", "params": {**ADAM_LIKE, "amsgrad": True}},
    {
        "type": "SGD",
        "params": {
            "lr": 0.1,
            "momentum": 0.9,
            "dampening": 0.0,
            "weight_decay": 0.0,
            "nesterov": True,
            "maximize": False,
            "foreach": False,
        },
    },
    {
        "type": "Adagrad",
        "params": {
            "lr": 0.01,
            "lr_decay": 0.0,
            "weight_decay": 0.0,
            "initial_accumulator_value": 0.1,
            "eps": 1e-10,
            "foreach": None,
        },
    },
    {
        "type": "RMSprop",
        "params": {
            "lr": 0.01,
            "alpha": 0.99,
            "eps": 1e-8,
            "weight_decay": 0.0,
            "momentum": 0.5,
            "centered": True,
            "capturable": False,
        },
    },
    {"type": "Adamax", "params": {**ADAM_LIKE}},
    {"type": "NAdam", "params": {**ADAM_LIKE, "momentum_decay": 0.004, "decoupled_weight_decay": True}},
    {"type": "RAdam", "params": {**ADAM_LIKE, "decoupled_weight_decay": False}},
]
# "none": the ddp backend of EVERY_SECTION refuses an offload it would not do
OFFLOAD = {"device": "none", "nvme_path": None, "buffer_count": 4, "pin_memory": True}
EVERY_SECTION: dict[str, Any] = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
             "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1, "auto_cast": False},
    "bf16": {"enabled": False},
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "zero_optimization": {
        "stage": 1, "allgather_partitions": True, "allgather_bucket_size": 5e8, "overlap_comm": None,
        "reduce_scatter": True, "reduce_bucket_size": 500000000, "contiguous_gradients": True,
        "offload_optimizer": {**OFFLOAD, "pipeline_read": False, "ratio": 1.0, "cpuadam_cores_perc": 0.8},
        "offload_param": {**OFFLOAD, "buffer_size": 100000000, "max_in_cpu": 1000000000},
        "sub_group_size": 1000000000, "stage3_max_live_parameters": 1000000000,
        "stage3_param_persistence_threshold": 100000,
        "stage3_gather_16bit_weights_on_model_save": False,
    },
    "checkpoint": {"path": "/tmp/sail-fuzz-never-written", "interval_steps": 10, "interval_seconds": 60.0,
                   "keep_last": 2, "async_save": False, "save_on_preemption": True, "tag_validation": "Warn",
                   "load_universal": False, "use_node_local_storage": False,
                   "parallel_write": {"pipeline_stage": False}},
    "snn": {"enabled": False, "reset": "per_batch", "step_mode": "m", "time_steps": 4, "encoding": "poisson",
            "sync_batchnorm": False},
    "compile": {"enabled": False, "backend": "inductor", "kwargs": {"options": {}}, "mode": "default",
                "dynamic": None, "fullgraph": False, "modules": ["0"]},
    "sail": {"backend": "ddp", "dist_backend": "gloo", "seed": 7, "progress_bar": False,
             "metrics_path": "metrics.jsonl", "timeout_minutes": 30, "find_unused_parameters": False,
             "move_inputs_to_device": True},
}  # fmt: skip


def configs() -> dict[str, tuple[dict[str, Any], tuple[str, ...]]]:
    """The repository's example configs and configs that set every key of every section, each with
    the sections whose keys are mutated (all, or only those that differ from the first config)."""
    found: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
        str(path.relative_to(ROOT)): (json.loads(path.read_text()), ())
        for path in [
            *sorted((ROOT / "examples/configs").glob("*.json")),
            ROOT / "examples/seed000/ds_config.json",
        ]
    }
    for i, optimizer in enumerate(OPTIMIZERS):
        name = f"every section, {optimizer['type']} #{i} + {SCHEDULERS[i % 3]['type']}"
        config = {**EVERY_SECTION, "optimizer": optimizer, "scheduler": SCHEDULERS[i % 3]}
        found[name] = (config, () if i == 0 else ("optimizer", "scheduler"))
    found["bfloat16"] = ({"train_micro_batch_size_per_gpu": 2, "bfloat16": {"enabled": True},
                          "optimizer": OPTIMIZERS[0], "sail": {"seed": 0}}, ())  # fmt: skip
    found["horovod"] = ({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
        "optimizer": OPTIMIZERS[3], "sail": {"backend": "horovod"},
        "horovod": {"compression": "fp16", "op": "Average", "backward_passes_per_step": 2},
    }, ())  # fmt: skip
    return found


def paths(value: Any, prefix: str = "") -> Iterator[str]:
    """Every key path in a config: 'optimizer', 'optimizer.params', 'optimizer.params.betas[0]', ..."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        path = f"{prefix}[{key}]" if isinstance(key, int) else f"{prefix}.{key}" if prefix else key
        yield path
        yield from paths(child, path)


def replaced(config: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(config)
    parts = [int(p) if p.isdigit() else p for p in path.replace("[", ".").replace("]", "").split(".")]
    parent = out
    for part in parts[:-1]:
        parent = parent[part]
    parent[parts[-1]] = value
    return out


def mutations(config: dict[str, Any], sections: tuple[str, ...]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(path, what was done, mutated config): each value replaced by each kind of garbage, and an
    unknown key added inside every object; only under ``sections`` when some are named."""
    for path in paths(config):
        if sections and path.split(".")[0] not in sections:
            continue
        for garbage in GARBAGE:
            yield path, f"= {garbage!r}", replaced(config, path, garbage)
        original = eval_path(config, path)
        if isinstance(original, dict):
            yield path, "+ an unknown key", replaced(config, path, {**original, "zz_unknown": 1})


def eval_path(config: dict[str, Any], path: str) -> Any:
    value: Any = config
    for part in path.replace("[", ".").replace("]", "").split("."):
        value = value[int(part)] if part.isdigit() else value[part]
    return value


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """seed_everything seeds the global generators; the other tests must not notice."""
    state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(state[0])
    np.random.set_state(state[1])


def prepare_and_step(raw: dict[str, Any]) -> None:
    """What initialize and the engine do with a config, in their order, on one CPU process."""
    config = load_config(raw, world_size=1)
    backend = backend_class(config.sail.backend, config.source)
    _check_zero_stage(config, backend.name, backend.max_zero_stage)
    _check_offload(config, backend)
    if backend.name == "horovod":
        horovod_options(config)
    model = torch.nn.Linear(2, 1)
    checked: torch.nn.Module = model
    if config.snn.enabled:  # for a model of spiking neurons: SpikingSupport refuses another, naming it
        from spikingjelly.activation_based import neuron

        checked = torch.nn.Sequential(model, neuron.IFNode(step_mode=config.snn.step_mode))
    SpikingSupport.for_model(config.snn, checked, config.source)
    with rng_kept():
        if config.sail.seed is not None:
            seed_everything(config.sail.seed)
    datetime.timedelta(minutes=config.sail.timeout_minutes)
    if config.optimizer is None:  # the examples without one pass the script's own
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        optimizer = build_optimizer(config.optimizer, model.parameters(), config.source)
    precision = select_precision(config.fp16, config.bf16, torch.device("cpu"))
    scheduler = build_scheduler(config.scheduler, optimizer, config.source) if config.scheduler else None
    with precision.autocast():  # an elementwise loss: a matmul under CPU autocast is slow
        loss = (model.weight.float() * 2).pow(2).sum() + model.bias.float().sum()
    precision.scale_loss(loss).backward()
    overflow = precision.unscale_(optimizer)
    if config.gradient_clipping > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.gradient_clipping)
    if not overflow:
        optimizer.step()
    precision.update(overflow)
    if scheduler is not None:
        scheduler.step()


def holds_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return any(holds_non_finite(v) for v in children)


def problem(path: str, config: dict[str, Any]) -> str | None:
    """None when the config works or is refused with SpikingSail's own error naming ``path``."""
    try:
        prepare_and_step(config)
    except SailError as err:
        named = path in str(err) or f"'{path}'" in str(err)
        return None if named else f"{type(err).__name__} without the key path: {err}"
    except Exception:
        return "raw exception:\n" + traceback.format_exc(limit=-3)
    if holds_non_finite(eval_path(config, path)):
        return "accepted a NaN or an infinity"
    return None


@pytest.mark.parametrize("name", list(configs()))
def test_every_mutation_loads_or_names_the_key(name: str) -> None:
    config, sections = configs()[name]
    prepare_and_step(config)  # the unmutated config works
    failures = [
        f"{path} {what}: {found}"
        for path, what, mutated in mutations(config, sections)
        if (found := problem(path, mutated)) is not None
    ]
    assert not failures, f"{len(failures)} mutation(s) of {name}:\n" + "\n\n".join(failures[:20])


def test_the_fuzz_reaches_every_section() -> None:
    """The mutated configs cover every section and every optimizer and scheduler type."""
    every = {p.split(".")[0] for c, _ in configs().values() for p in paths(c)}
    assert {"fp16", "bf16", "bfloat16", "optimizer", "scheduler", "zero_optimization", "checkpoint", "snn",
            "compile", "sail", "horovod", "gradient_clipping", "steps_per_print", "train_batch_size"} <= every  # fmt: skip
    types = {c[s]["type"] for c, _ in configs().values() for s in ("optimizer", "scheduler") if s in c}
    assert {"Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam",
            "OneCycle", "WarmupLR", "WarmupDecayLR"} <= types  # fmt: skip
