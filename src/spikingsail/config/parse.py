"""The one boundary where a user's config is read and validated.

``load_config`` takes a JSON path or a dict and the world size and returns a ``SailConfig`` whose
batch-size triple is consistent, or raises ``ConfigError`` naming the file, the key and the fix.
It runs before any process group exists, so a mistake never leaves ranks waiting on each other.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol, Union, get_args, get_origin, get_type_hints

from spikingsail.checks import FLOAT32_MAX, INT64_MAX, Range, check_number, refuse_non_finite, reject_unknown
from spikingsail.config.compiling import refuse_deepcompile
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
# (unless a backend that honours them is chosen), where DeepSpeed is not installed to say which keys
# it reads (``Library.keys``); those of DeepSpeed 0.19.8, the pinned version, less those it removed.
# They are reported, never silently dropped.
INERT_DEEPSPEED_KEYS = frozenset(
    {
        "wall_clock_breakdown",
        "memory_breakdown",
        "prescale_gradients",
        "gradient_predivide_factor",
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
        "data_types",
        "autotuning",
        "data_efficiency",
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
FOR_DEEPSPEED = frozenset(_SECTIONS) - NOT_FOR_DEEPSPEED
"""The table's sections DeepSpeed reads too (fp16, bf16, zero_optimization, optimizer, scheduler)."""
_NO_SECTIONS: Mapping[str, type[Any]] = types.MappingProxyType({})


class Library(Protocol):
    """What the chosen backend (and the library it runs on) makes of a config; ``spikingsail.backends``
    gives one for every registered backend."""

    def data_parallel_size(self, backend: str, world_size: int, sections: dict[str, Any]) -> int:
        """The data-parallel replicas ``world_size`` processes make (the batch sizes count those)."""

    def checks(self, backend: str) -> frozenset[str]:
        """The sections shared with SpikingSail's table whose keys SpikingSail does not read the
        library checks itself (SpikingSail then leaves those to it, in ``keys``)."""

    def keys(self, config: SailConfig) -> frozenset[str] | None:
        """The top-level keys outside SpikingSail's table that the library reads, once it has checked
        them; None where there is no library here to ask."""


def load_config(
    source: str | Path | dict[str, Any] | None,
    world_size: int,
    backend_sections: Mapping[str, type[Any]] = _NO_SECTIONS,
    library: Library | None = None,
) -> SailConfig:
    """Read, validate and resolve a config for ``world_size`` processes.

    ``backend_sections`` adds top-level sections owned by others (a backend's options: name → dataclass),
    checked here like the table's own and handed back in ``SailConfig.backend_sections``. ``library``
    says what the chosen backend's library reads and checks (DeepSpeed's keys, by DeepSpeed itself);
    without one, the DeepSpeed keys in ``INERT_DEEPSPEED_KEYS`` are accepted. ``spikingsail.backends.load_config``
    passes every registered backend's sections and the library.
    """
    raw, where = read_config(source)
    raw = _auto(raw, where)
    backend = _backend_named(raw)
    checked = library.checks(backend) if library is not None else frozenset()
    for canonical in {found.field for found in _SECTIONS.values()}:
        spelled = [name for name, found in _SECTIONS.items() if found.field == canonical and name in raw]
        if len(spelled) > 1:
            raise ConfigError(
                f"{where}: both {' and '.join(map(repr, spelled))} are set",
                "they are two spellings of the same section",
                f"keep only '{canonical}'",
            )
    # DeepSpeed's DeepCompile keys are DeepSpeed's to check (the section is in checked) and run
    refuse_deepcompile(raw, where, backend, runs_it="compile" in checked)
    given = {
        found.field: _build(found.cls, raw[name], where, name, lenient=name in checked)
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
    if library is not None:
        world_size = library.data_parallel_size(backend, world_size, sections)
    micro, accum, total = _resolve_batch(raw, world_size, where)
    config = SailConfig(
        train_batch_size=total,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accum,
        world_size=world_size,
        zero_optimization=build_zero(
            raw.get("zero_optimization", False), where, lenient="zero_optimization" in checked
        ),
        backend_sections=sections,
        source=where,
        raw=raw,
        **given,
        **values,
    )
    foreign = sorted(set(raw) - TOP_LEVEL_KEYS - sections.keys())
    known = library.keys(config) if library is not None and (foreign or checked & raw.keys()) else None
    reject_unknown(raw, TOP_LEVEL_KEYS | backend_sections.keys() | (INERT_DEEPSPEED_KEYS if known is None else known),
                   where, "the top level")  # fmt: skip
    config = dataclasses.replace(config, inert_keys=tuple(foreign))
    _check_semantics(config, checked)
    return config


# The sections DeepSpeed reads through its config models, which take "auto" as the field's default.
_AUTO_IS_DEFAULT = frozenset({"fp16", "bf16", "bfloat16", "zero_optimization"})


def _auto(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """``"auto"`` as DeepSpeed reads it: in the sections of its config models the field's default;
    elsewhere (batch sizes, clipping, optimizer and scheduler parameters) a value the Hugging Face
    Trainer fills in before DeepSpeed reads the file, which nothing fills here."""
    out = dict(raw)
    for name in _AUTO_IS_DEFAULT & raw.keys():
        if isinstance(raw[name], dict):
            out[name] = {key: value for key, value in raw[name].items() if value != "auto"}
    placeholders = [key for key, value in raw.items() if value == "auto"] + [
        f"{name}.params.{key}"
        for name in ("optimizer", "scheduler")
        if isinstance(raw.get(name), dict) and isinstance(raw[name].get("params"), dict)
        for key, value in raw[name]["params"].items()
        if value == "auto"
    ]
    if placeholders:
        raise ConfigError(
            f'{where}: {", ".join(placeholders)} {"is" if len(placeholders) == 1 else "are"} "auto"',
            '"auto" is a placeholder that the Hugging Face Trainer\'s DeepSpeed integration fills in '
            "before DeepSpeed reads the file; SpikingSail reads it as DeepSpeed's own launcher does, "
            "where nothing fills it (DeepSpeed itself would fail on it: at once for a batch size, once "
            'training starts for the others; it reads "auto" as the default only in fp16, bf16 and '
            "zero_optimization)",
            "give the value, or run the script under the Hugging Face Trainer, which fills it",
        )
    return out


def _backend_named(raw: dict[str, Any]) -> str:
    """``sail.backend`` as written (its section is checked with the others), else the default."""
    sail = raw.get("sail")
    name = sail.get("backend") if isinstance(sail, dict) else None
    return name.lower() if isinstance(name, str) else SailSection().backend


def _build(cls: type[Any], raw: Any, where: str, name: str, *, lenient: bool = False) -> Any:
    """The section ``name`` as ``cls``; ``lenient``: the keys ``cls`` lacks are a library's, which
    checked them (DeepSpeed's ``bf16.bf16_master_weights_and_grads``), not unknown."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: '{name}' must be an object", f"found {raw!r}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if lenient:
        raw = {key: value for key, value in raw.items() if key in fields}
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
    refuse_non_finite(converted, key, where)  # inside an object too (torch.compile's kwargs)
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


def _check_semantics(config: SailConfig, checked: frozenset[str]) -> None:
    """What one key's type and range cannot say: names, paths, and keys that must agree. The
    optimizer and scheduler sections are the library's where it builds them (DeepSpeed's Lamb)."""
    where = config.source
    if config.fp16.enabled and config.bf16.enabled:
        raise ConfigError(
            f"{where}: fp16.enabled and bf16.enabled are both true",
            "a run uses one mixed-precision mode",
            "keep bf16 on GPUs that support it (A100, H100), fp16 otherwise (V100)",
        )
    if config.optimizer is not None and "optimizer" not in checked:
        resolve_optimizer(config.optimizer, where)
    if config.scheduler is not None and "scheduler" not in checked:
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
