"""The one boundary where a user's config is read and validated.

``load_config`` takes a JSON path or a dict and the world size and returns a ``SailConfig`` whose
batch-size triple is consistent, or raises ``ConfigError`` naming the file, the key and the fix.
It runs before any process group exists, so a mistake never leaves ranks waiting on each other.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from spikingsail.config.schema import (
    BF16Config,
    CheckpointConfig,
    FP16Config,
    OptimizerConfig,
    SailConfig,
    SailSection,
    SchedulerConfig,
    SNNConfig,
    ZeroConfig,
)
from spikingsail.errors import ConfigError
from spikingsail.optim.optimizers import resolve_optimizer
from spikingsail.optim.schedulers import check_scheduler

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

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

ZERO_KEYS = frozenset(
    {
        "stage",
        "allgather_partitions",
        "allgather_bucket_size",
        "overlap_comm",
        "reduce_scatter",
        "reduce_bucket_size",
        "contiguous_gradients",
        "offload_optimizer",
        "offload_param",
        "sub_group_size",
        "round_robin_gradients",
        "elastic_checkpoint",
        "load_from_fp32_weights",
        "ignore_unused_parameters",
        "use_multi_rank_bucket_allreduce",
        "cpu_offload",
        "cpu_offload_params",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
        "stage3_model_persistence_threshold",
        "zero_hpz_partition_size",
        "zero_quantized_weights",
        "zero_quantized_gradients",
        "mics_shard_size",
        "memory_efficient_linear",
        "gather_16bit_weights_on_model_save",
    }
)

_SECTIONS: dict[str, type[Any]] = {
    "fp16": FP16Config,
    "bf16": BF16Config,
    "bfloat16": BF16Config,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "sail": SailSection,
    "checkpoint": CheckpointConfig,
    "snn": SNNConfig,
}
_SCALARS: dict[str, type[Any]] = {
    "gradient_clipping": float,
    "steps_per_print": int,
}
# Sections read and validated by the backend they belong to (when it is chosen).
BACKEND_SECTIONS = frozenset({"horovod"})
TOP_LEVEL_KEYS = frozenset({*BATCH_KEYS, *_SECTIONS, *_SCALARS, *BACKEND_SECTIONS, "zero_optimization"})


def load_config(source: str | Path | dict[str, Any] | None, world_size: int) -> SailConfig:
    """Read, validate and resolve a config for ``world_size`` processes."""
    raw, where = _read(source)
    _reject_unknown(raw, TOP_LEVEL_KEYS | INERT_DEEPSPEED_KEYS, where, "the top level")
    if "bf16" in raw and "bfloat16" in raw:
        raise ConfigError(
            f"{where}: both 'bf16' and 'bfloat16' are set",
            "they are two spellings of the same section",
            "keep only 'bf16'",
        )
    sections = {
        name.replace("bfloat16", "bf16"): _build(cls, raw[name], where, name)
        for name, cls in _SECTIONS.items()
        if name in raw
    }
    scalars = {name: _coerce(raw[name], kind, where, name) for name, kind in _SCALARS.items() if name in raw}
    micro, accum, total = _resolve_batch(raw, world_size, where)
    config = SailConfig(
        train_batch_size=total,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accum,
        world_size=world_size,
        zero_optimization=_build_zero(raw.get("zero_optimization", False), where),
        inert_keys=tuple(sorted(k for k in raw if k in INERT_DEEPSPEED_KEYS)),
        source=where,
        raw=raw,
        **sections,
        **scalars,
    )
    _check_semantics(config)
    return config


def _read(source: str | Path | dict[str, Any] | None) -> tuple[dict[str, Any], str]:
    if source is None:
        return {}, "<no config>"
    if isinstance(source, dict):
        return dict(source), "<dict>"
    path = Path(source)
    if not path.is_file():
        raise ConfigError(
            f"config file {path} does not exist",
            "--sail-config / --deepspeed_config must name a JSON file",
            "check the path, or pass a dict to spikingsail.initialize(config=...)",
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{path}:{err.lineno}:{err.colno}: not valid JSON",
            err.msg,
            "fix the JSON at that line (trailing commas and comments are not allowed)",
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a JSON object", f"found {type(raw).__name__}")
    return raw, str(path)


def _reject_unknown(raw: dict[str, Any], valid: frozenset[str] | set[str], where: str, scope: str) -> None:
    for key in raw:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(
                f"{where}: unknown key '{key}' in {scope}",
                "SpikingSail rejects keys it does not know so that a typo never goes unnoticed",
                f"{hint}valid keys: {', '.join(sorted(valid))}",
            )


def _build(cls: type[Any], raw: Any, where: str, name: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: '{name}' must be an object", f"found {raw!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _reject_unknown(raw, set(fields), where, f"'{name}'")
    missing = [
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and n not in raw
    ]
    if missing:
        raise ConfigError(f"{where}: '{name}' needs the key '{missing[0]}'", fix=f'add "{missing[0]}"')
    kwargs = {k: _coerce(v, hints[k], where, f"{name}.{k}") for k, v in raw.items()}
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, where: str, key: str) -> Any:
    """Check one JSON value against a field type; ints are accepted where floats are expected."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in get_args(hint):
            return None
        (inner,) = (a for a in get_args(hint) if a is not type(None))
        return _coerce(value, inner, where, key)
    if origin is dict:
        if isinstance(value, dict):
            return dict(value)
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif hint is str and isinstance(value, str):
        return value
    expected = getattr(hint, "__name__", str(hint)).replace("dict", "object")
    raise ConfigError(f"{where}: '{key}' must be {expected}", f"found {value!r}")


def _build_zero(raw: Any, where: str) -> ZeroConfig:
    # DeepSpeed's legacy boolean form: true means stage 1, false means off.
    if isinstance(raw, bool):
        return ZeroConfig(stage=1 if raw else 0)
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: 'zero_optimization' must be an object or a boolean", f"found {raw!r}")
    _reject_unknown(raw, ZERO_KEYS, where, "'zero_optimization'")
    stage = _coerce(raw.get("stage", 0), int, where, "zero_optimization.stage")
    if stage not in (0, 1, 2, 3):
        raise ConfigError(
            f"{where}: zero_optimization.stage is {stage}",
            "ZeRO has stages 0 (off), 1, 2 and 3",
            "pick one of 0, 1, 2, 3",
        )
    return ZeroConfig(stage=stage, options={k: v for k, v in raw.items() if k != "stage"})


def _resolve_batch(raw: dict[str, Any], world_size: int, where: str) -> tuple[int, int, int]:
    """DeepSpeed's rule: any two of the three batch keys imply the third."""
    given = {k: _coerce(raw[k], int, where, k) for k in BATCH_KEYS if raw.get(k) is not None}
    for key, value in given.items():
        if value < 1:
            raise ConfigError(f"{where}: '{key}' is {value}", "batch sizes and steps must be ≥ 1")
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
    where = config.source
    if config.fp16.enabled and config.bf16.enabled:
        raise ConfigError(
            f"{where}: fp16.enabled and bf16.enabled are both true",
            "a run uses one mixed-precision mode",
            "keep bf16 on GPUs that support it (A100, H100), fp16 otherwise (V100)",
        )
    fp16 = config.fp16
    if fp16.loss_scale < 0 or fp16.min_loss_scale <= 0 or fp16.loss_scale_window < 1 or fp16.hysteresis < 1:
        raise ConfigError(
            f"{where}: fp16 loss-scale settings out of range",
            "loss_scale must be ≥ 0, min_loss_scale > 0, loss_scale_window ≥ 1, hysteresis ≥ 1",
            "use DeepSpeed's defaults: loss_scale 0, min_loss_scale 1, loss_scale_window 1000, hysteresis 2",
        )
    if config.gradient_clipping < 0:
        raise ConfigError(
            f"{where}: gradient_clipping is {config.gradient_clipping}", "it must be ≥ 0 (0 = off)"
        )
    if config.steps_per_print < 1:
        raise ConfigError(f"{where}: steps_per_print is {config.steps_per_print}", "it must be ≥ 1")
    if config.sail.dist_backend not in ("auto", "nccl", "gloo"):
        raise ConfigError(
            f"{where}: sail.dist_backend is '{config.sail.dist_backend}'",
            "SpikingSail runs on nccl (GPU) or gloo (CPU)",
            "use auto, nccl or gloo",
        )
    if config.optimizer is not None:
        resolve_optimizer(config.optimizer, where)
    if config.scheduler is not None:
        check_scheduler(config.scheduler, where)
    ckpt = config.checkpoint
    if ckpt.interval_steps < 0 or ckpt.interval_seconds < 0 or ckpt.keep_last < 0:
        raise ConfigError(
            f"{where}: checkpoint.interval_steps, interval_seconds and keep_last must be ≥ 0",
            fix="use 0 to turn each off",
        )
    snn = config.snn
    for key, value, allowed in (("reset", snn.reset, ("per_batch", "off")),
                                ("step_mode", snn.step_mode, (None, "s", "m")),
                                ("encoding", snn.encoding, ("repeat", "poisson"))):  # fmt: skip
        if value not in allowed:
            raise ConfigError(
                f"{where}: snn.{key} is {value!r}",
                fix=f"use one of {', '.join(repr(a) for a in allowed if a is not None)}"
                + (" (or leave it out)" if None in allowed else ""),
            )
    if snn.time_steps < 1:
        raise ConfigError(f"{where}: snn.time_steps is {snn.time_steps}", "it must be ≥ 1")
    if config.sail.timeout_minutes <= 0:
        raise ConfigError(f"{where}: sail.timeout_minutes must be > 0")
