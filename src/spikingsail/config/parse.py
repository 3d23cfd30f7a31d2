"""The one boundary where a user's config is read and validated.

``load_config`` takes a JSON path or a dict and the world size and returns a ``SailConfig`` whose
batch-size triple is consistent, or raises ``ConfigError`` naming the file, the key and the fix.
It runs before any process group exists, so a mistake never leaves ranks waiting on each other.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from spikingsail.checks import FLOAT32_MAX, INT64_MAX, Range, check_number, reject_unknown
from spikingsail.config.files import read_config
from spikingsail.config.schema import (
    BATCH_KEYS,
    SailConfig,
    SailSection,
    scalars,
    sections,
)
from spikingsail.config.zero import build_zero
from spikingsail.errors import ConfigError
from spikingsail.monitor.trackers import TRACKERS
from spikingsail.optim.optimizers import resolve_optimizer
from spikingsail.optim.schedulers import check_scheduler

_BATCH_RANGE = Range(1, INT64_MAX, integer=True, why="batch sizes and steps are ≥ 1, and the loss is divided "
                     "by the accumulation steps as an int64")  # fmt: skip

# DeepSpeed keys a DeepSpeed user's file may carry that SpikingSail accepts without acting on them
# (unless a backend that honours them is chosen). They are reported, never silently dropped.
INERT_DEEPSPEED_KEYS = frozenset(
    {
        "wall_clock_breakdown",
        "memory_breakdown",
        "prescale_gradients",
        "gradient_predivide_factor",
        "sparse_gradients",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "communication_data_type",
        "seq_parallel_communication_data_type",
        "dump_state",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "comms_logger",
        "flops_profiler",
        "activation_checkpointing",
        "aio",
        "amp",
        "data_types",
        "elasticity",
        "autotuning",
        "compression_training",
        "data_efficiency",
        "curriculum_learning",
        "pipeline",
        "disable_allgather",
        "steps_per_print_timers",
    }
)

# The config table, from SailConfig's fields: every top-level section (by each name it may have),
# its dataclass and whether DeepSpeed reads it too (the deepspeed backend hands DeepSpeed the file
# without the sections it does not), and the keys of one value.
_SECTIONS = sections()
_SCALARS = scalars()
TOP_LEVEL_KEYS = frozenset({*BATCH_KEYS, *_SECTIONS, *_SCALARS})
NOT_FOR_DEEPSPEED = frozenset(name for name, found in _SECTIONS.items() if not found.deepspeed)
"""The table's sections the deepspeed backend leaves out of what it hands ``deepspeed.initialize``
(with every backend's own section: DeepSpeed reads none of them)."""
_NO_SECTIONS: Mapping[str, type[Any]] = types.MappingProxyType({})


def load_config(
    source: str | Path | dict[str, Any] | None,
    world_size: int,
    backend_sections: Mapping[str, type[Any]] = _NO_SECTIONS,
    data_parallel_size: Callable[[str, dict[str, Any]], int] | None = None,
) -> SailConfig:
    """Read, validate and resolve a config for ``world_size`` processes.

    ``backend_sections`` adds top-level sections owned by others (a backend's options: name → dataclass),
    checked here like the table's own and handed back in ``SailConfig.backend_sections``.
    ``data_parallel_size(backend, sections)`` says how many data-parallel replicas the processes
    make under the chosen backend (all of them when not given): the batch sizes count those.
    ``spikingsail.backends.load_config`` passes every registered backend's sections and sizes.
    """
    raw, where = read_config(source)
    reject_unknown(
        raw, TOP_LEVEL_KEYS | backend_sections.keys() | INERT_DEEPSPEED_KEYS, where, "the top level"
    )
    for canonical in {found.field for found in _SECTIONS.values()}:
        spelled = [name for name, found in _SECTIONS.items() if found.field == canonical and name in raw]
        if len(spelled) > 1:
            raise ConfigError(
                f"{where}: both {' and '.join(map(repr, spelled))} are set",
                "they are two spellings of the same section",
                f"keep only '{canonical}'",
            )
    given = {
        found.field: _build(found.cls, raw[name], where, name)
        for name, found in _SECTIONS.items()
        if name in raw and found.field != "zero_optimization"  # DeepSpeed's rules: config.zero
    }
    top = {f.name: f for f in dataclasses.fields(SailConfig)}
    values = {
        name: _value(raw[name], kind, top[name], where, name)
        for name, kind in _SCALARS.items()
        if name in raw
    }
    sections = {
        name: _build(cls, raw[name], where, name) for name, cls in backend_sections.items() if name in raw
    }
    if data_parallel_size is not None:
        backend = given["sail"].backend if "sail" in given else SailSection().backend
        world_size = data_parallel_size(backend, sections)
    micro, accum, total = _resolve_batch(raw, world_size, where)
    config = SailConfig(
        train_batch_size=total,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accum,
        world_size=world_size,
        zero_optimization=build_zero(raw.get("zero_optimization", False), where),
        inert_keys=tuple(sorted(k for k in raw if k in INERT_DEEPSPEED_KEYS)),
        backend_sections=sections,
        source=where,
        raw=raw,
        **given,
        **values,
    )
    _check_semantics(config)
    return config


def _build(cls: type[Any], raw: Any, where: str, name: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: '{name}' must be an object", f"found {raw!r}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    reject_unknown(raw, set(fields), where, f"'{name}'")
    missing = [
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and n not in raw
    ]
    if missing:
        raise ConfigError(f"{where}: '{name}' needs the key '{missing[0]}'", fix=f'add "{missing[0]}"')
    kwargs = {k: _value(v, hints[k], fields[k], where, f"{name}.{k}") for k, v in raw.items()}
    return cls(**kwargs)


_HINTS: dict[type[Any], dict[str, Any]] = {}


def _hints(cls: type[Any]) -> dict[str, Any]:
    if cls not in _HINTS:  # get_type_hints evaluates every annotation: slow enough to matter in a loop
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def _value(value: Any, hint: Any, declared: dataclasses.Field[Any], where: str, key: str) -> Any:
    """A field's value: of its type and, for numbers, within the range the schema declares."""
    if declared.metadata.get("parse") == "balance":
        return _balance(value, where, key)
    if declared.metadata.get("parse") == "time_chunk":
        return _time_chunk(value, where, key)
    if declared.metadata.get("parse") == "trackers":  # the names of the trackers' registry
        return _coerce(value, tuple[Literal[TRACKERS], ...], where, key)  # type: ignore[valid-type]
    if declared.metadata.get("any_case") and isinstance(value, str):  # a choice spelled in any case
        value = next((a for a in _literal_args(hint) if a.lower() == value.lower()), value)
    # every float is at least finite: NaN would turn a check like "clip when > 0" silently off
    allowed: Range | None = declared.metadata.get("range") or (Range() if hint is float else None)
    if allowed is None or value is None:
        return _coerce(value, hint, where, key)
    return check_number(value, allowed, key, where)


def _coerce(value: Any, hint: Any, where: str, key: str) -> Any:
    """Check one JSON value against a field type; ints are accepted where floats are expected."""
    optional = get_origin(hint) in (Union, types.UnionType) and type(None) in get_args(hint)
    if optional:
        if value is None:
            return None
        (hint,) = (a for a in get_args(hint) if a is not type(None))
    if get_origin(hint) is Literal:
        return _choice(value, get_args(hint), where, key, optional)
    if get_origin(hint) is tuple:  # tuple[X, ...]: a JSON list of X
        if not isinstance(value, list):
            raise ConfigError(f"{where}: '{key}' must be a list", f"found {value!r}")
        item = get_args(hint)[0]
        return tuple(_coerce(v, item, where, f"{key}[{i}]") for i, v in enumerate(value))
    converted = _scalar(value, hint)
    if converted is _WRONG_TYPE:
        expected = getattr(hint, "__name__", str(hint)).replace("dict", "object")
        raise ConfigError(f"{where}: '{key}' must be {expected}", f"found {value!r}")
    return converted


_WRONG_TYPE = object()


def _literal_args(hint: Any) -> tuple[str, ...]:
    options = (
        [a for a in get_args(hint) if a is not type(None)] if get_origin(hint) is not Literal else [hint]
    )
    return tuple(arg for a in options if get_origin(a) is Literal for arg in get_args(a))


def _scalar(value: Any, hint: Any) -> Any:
    """``value`` as ``hint`` (a JSON object, bool, int, float or str), or ``_WRONG_TYPE``."""
    if get_origin(hint) is dict:
        return dict(value) if isinstance(value, dict) else _WRONG_TYPE
    if hint is bool:
        return value if isinstance(value, bool) else _WRONG_TYPE
    if isinstance(value, bool):
        return _WRONG_TYPE
    if hint is int:
        if isinstance(value, int):
            return value
        # 1e3 or 1000.0 in a DeepSpeed file: DeepSpeed reads a whole float as an integer
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, int | float):
            return float(value)
    elif hint is str and isinstance(value, str):
        return value
    return _WRONG_TYPE


_BALANCE_WEIGHT = Range(
    0, FLOAT32_MAX, low_open=True, why="a weight is a rank's relative speed", fix="e.g. 3 and 1"
)


def _balance(value: Any, where: str, key: str) -> str | tuple[float, ...] | dict[str, float]:
    """``sail.balance``: "off", "auto", a list of per-rank weights or a {"host": weight} map."""
    if value in ("off", "auto"):
        return str(value)
    if isinstance(value, list) and value:
        return tuple(
            float(check_number(w, _BALANCE_WEIGHT, f"{key}[{i}]", where)) for i, w in enumerate(value)
        )
    if isinstance(value, dict) and value:
        return {
            str(h): float(check_number(w, _BALANCE_WEIGHT, f"{key}.{h}", where)) for h, w in value.items()
        }
    raise ConfigError(
        f"{where}: {key} is {value!r}",
        "it is how each global micro-batch is split over the ranks",
        'use "off", "auto", a weight per rank (e.g. [3, 1]) or one per host (e.g. {"node1": 2, "node2": 1})',
    )


def _time_chunk(value: Any, where: str, key: str) -> int | str:
    """``snn.time_chunk``: 0 (off), a number of time steps per chunk, or "auto"."""
    if value == "auto" and isinstance(value, str):
        return value
    if isinstance(value, str):
        raise ConfigError(
            f"{where}: {key} is {value!r}", fix='use a number of time steps (0 = off) or "auto"'
        )
    return int(check_number(value, _TIME_CHUNK, key, where))


_TIME_CHUNK = Range(
    0, INT64_MAX, integer=True, fix='e.g. 4, or "auto" with snn.memory_budget_mb',
    why="it is how many time steps one recomputed chunk holds (0 = off)",
)  # fmt: skip


def _choice(value: Any, allowed: tuple[Any, ...], where: str, key: str, optional: bool) -> Any:
    if value in allowed and isinstance(value, str):
        return value
    raise ConfigError(
        f"{where}: {key} is {value!r}",
        fix=f"use one of {', '.join(repr(a) for a in allowed)}" + (" (or leave it out)" if optional else ""),
    )


def _resolve_batch(raw: dict[str, Any], world_size: int, where: str) -> tuple[int, int, int]:
    """DeepSpeed's rule: any two of the three batch keys imply the third."""
    given = {
        k: int(check_number(_coerce(raw[k], int, where, k), _BATCH_RANGE, k, where))
        for k in BATCH_KEYS
        if raw.get(k) is not None
    }
    total = given.get("train_batch_size")
    micro = given.get("train_micro_batch_size_per_gpu")
    accum = given.get("gradient_accumulation_steps")
    if total is None and micro is None:
        raise ConfigError(
            f"{where}: neither 'train_batch_size' nor 'train_micro_batch_size_per_gpu' is set",
            "the engine needs the per-process micro batch to build data loaders and scale the loss",
            'add e.g. "train_micro_batch_size_per_gpu": 32',
        )
    if micro is None:
        assert total is not None
        accum = accum or 1
        micro = total // (accum * world_size)
    elif accum is None:
        accum = total // (micro * world_size) if total is not None else 1
    total = total if total is not None else micro * accum * world_size
    if micro < 1 or accum < 1 or total != micro * accum * world_size:
        raise ConfigError(
            f"{where}: inconsistent batch sizes for {world_size} process(es)",
            "train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × world_size, "
            f"but {_show(given)} with world_size {world_size} gives "
            f"{max(micro, 0)} × {max(accum, 0)} × {world_size} = {max(micro, 0) * max(accum, 0) * world_size}"
            f" ≠ {total}",
            "set two of the three keys and let SpikingSail derive the third, "
            "or choose a train_batch_size divisible by micro batch × world_size",
        )
    return micro, accum, total


def _show(given: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in given.items())


def _check_semantics(config: SailConfig) -> None:
    """What one key's type and range cannot say: names, paths, and keys that must agree."""
    where = config.source
    if config.fp16.enabled and config.bf16.enabled:
        raise ConfigError(
            f"{where}: fp16.enabled and bf16.enabled are both true",
            "a run uses one mixed-precision mode",
            "keep bf16 on GPUs that support it (A100, H100), fp16 otherwise (V100)",
        )
    if config.optimizer is not None:
        resolve_optimizer(config.optimizer, where)
    if config.scheduler is not None:
        check_scheduler(config.scheduler, where)
    _check_paths(config)
    if isinstance(config.sail.balance, tuple):
        check_balance_weights(list(config.sail.balance), config)
    _check_checkpoint(config)
    _check_snn(config)


def _check_snn(config: SailConfig) -> None:
    where, snn = config.source, config.snn
    if snn.time_chunk == "auto" and snn.memory_budget_mb is None:
        raise ConfigError(
            f'{where}: snn.time_chunk is "auto" but snn.memory_budget_mb is not set',
            "auto sizes the chunks so that one training forward's activations fit that budget",
            'add "memory_budget_mb" (MiB per rank), or give time_chunk a number of time steps',
        )
    if snn.memory_budget_mb is not None and snn.time_chunk != "auto":
        raise ConfigError(
            f"{where}: snn.memory_budget_mb is set but snn.time_chunk is {snn.time_chunk!r}",
            'only time_chunk "auto" reads the budget',
            'set "time_chunk": "auto", or drop memory_budget_mb',
        )
    if snn.time_chunk != 0 and snn.enabled is False:
        raise ConfigError(f"{where}: snn.time_chunk is {snn.time_chunk!r} but snn.enabled is false",
                          "time chunks carry spiking neurons' state from one chunk to the next",
                          "drop time_chunk, or turn the SNN support on")  # fmt: skip
    if snn.time_chunk != 0 and snn.step_mode == "s":
        raise ConfigError(
            f"{where}: snn.time_chunk is {snn.time_chunk!r} but snn.step_mode is 's'",
            "time chunks split the [T, N, ...] sequence of one multi-step call; in single-step mode "
            "the script calls the model once per time step",
            'set "step_mode": "m", or drop time_chunk',
        )


def check_balance_weights(weights: list[float], config: SailConfig, hosts: list[str] | None = None) -> None:
    """Weights for every rank, each giving its rank at least one sample of a global micro-batch;
    ``hosts``: each rank's host, when the weights were given per host."""
    where, world = config.source, config.world_size
    global_micro = config.train_micro_batch_size_per_gpu * world
    if len(weights) != world:
        raise ConfigError(
            f"{where}: sail.balance has {len(weights)} weight(s) for {world} process(es)",
            "it gives one weight per rank, in rank order",
            f'list {world} weights, or use a map from host to weight, or "auto"',
        )
    total = math.fsum(weights)
    for rank, weight in enumerate(weights):
        if global_micro * weight / total < 1:
            owner = f"rank {rank}" + (f" (host {hosts[rank]})" if hosts else "")
            raise ConfigError(
                f"{where}: sail.balance gives {owner} {global_micro * weight / total:.2f} of the "
                f"{global_micro} samples of a global micro-batch",
                "every rank needs at least one sample of each micro-batch",
                "raise its weight, or train_micro_batch_size_per_gpu (the mean share)",
            )


def _check_paths(config: SailConfig) -> None:
    metrics = config.sail.metrics_path
    if metrics is not None and not metrics.strip():
        raise ConfigError(f"{config.source}: sail.metrics_path is {metrics!r}", "it must name a file",
                          "set sail.metrics_path to a file, or leave it out")  # fmt: skip


def _check_checkpoint(config: SailConfig) -> None:
    where, ckpt = config.source, config.checkpoint
    if ckpt.path is not None and not ckpt.path.strip():
        raise ConfigError(f"{where}: checkpoint.path is {ckpt.path!r}", "it must name a directory",
                          "set checkpoint.path to a directory, or leave it out")  # fmt: skip
    if ckpt.tag_validation.upper() not in ("IGNORE", "WARN", "FAIL"):
        raise ConfigError(
            f"{where}: checkpoint.tag_validation is {ckpt.tag_validation!r}",
            "DeepSpeed's modes are Ignore, Warn and Fail (in any case)",
            "use 'Warn' (SpikingSail's tags are the same on every rank anyway)",
        )
    for key, value in ckpt.parallel_write.items():
        if key != "pipeline_stage" or not isinstance(value, bool):
            raise ConfigError(
                f"{where}: checkpoint.parallel_write.{key} is {value!r}",
                "DeepSpeed's parallel_write takes one key, pipeline_stage, true or false",
                'write "parallel_write": {"pipeline_stage": false}, or leave it out',
            )
