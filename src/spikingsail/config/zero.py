"""DeepSpeed's ``zero_optimization`` section: the keys it takes and the values each may have.

Every backend has the keys besides ``stage`` checked by the installed DeepSpeed's own config class
before any process group exists (``backends/deepspeed_keys.py``): the DeepSpeed backend hands them
to DeepSpeed; the others read only ``stage`` and warn that the rest have no effect. Where DeepSpeed
does not import, they are checked here with the types and bounds of DeepSpeed 0.19.8 (``ZERO_KEYS``,
without the keys it removed), so that a file that would fail under DeepSpeed fails here too, naming
the key.
"""

from __future__ import annotations

from typing import Any

from spikingsail.checks import INT64_MAX, Range, check_number, reject_unknown
from spikingsail.config.schema import ZeroConfig
from spikingsail.errors import ConfigError

_BOOL, _OPTIONAL_BOOL, _OFFLOAD, _OBJECT = "bool", "bool or null", "offload", "object or null"
_SIZE = Range(0, INT64_MAX, integer=True, why="DeepSpeed sizes its buffers with it (torch sizes are int64)")
_FRACTION = Range(0, 1)
_STAGE = Range(0, 3, integer=True, why="ZeRO has stages 0 (off), 1, 2 and 3")

# key -> its kind or range (DeepSpeed's runtime/zero/config.py and offload_config.py).
ZERO_KEYS: dict[str, str | Range] = {
    "stage": _STAGE,
    "allgather_partitions": _BOOL,
    "allgather_bucket_size": _SIZE,
    "overlap_comm": _OPTIONAL_BOOL,
    "reduce_scatter": _BOOL,
    "reduce_bucket_size": Range(1, INT64_MAX, integer=True, why="DeepSpeed sizes its buffers with it"),
    "contiguous_gradients": _BOOL,
    "offload_optimizer": _OFFLOAD,
    "offload_param": _OFFLOAD,
    "sub_group_size": _SIZE,
    "round_robin_gradients": _BOOL,
    "elastic_checkpoint": _BOOL,
    "load_from_fp32_weights": _BOOL,
    "ignore_unused_parameters": _BOOL,
    "use_multi_rank_bucket_allreduce": _BOOL,
    "cpu_offload": _OPTIONAL_BOOL,
    "cpu_offload_param": _OPTIONAL_BOOL,
    "cpu_offload_use_pin_memory": _OPTIONAL_BOOL,
    "compute_grad_norm": _BOOL,
    "zenflow": _OBJECT,
    "leaf_module": _OBJECT,
    "legacy_stage1": _BOOL,
    "parameter_alignment": _BOOL,
    "pipeline_loading_checkpoint": _BOOL,
    "override_module_apply": _BOOL,
    "log_trace_cache_warnings": _BOOL,
    "enable_sanity_checks": _BOOL,
    "save_muon_momentum_buffer_in_memory": _BOOL,
    "zero_quantized_nontrainable_weights": _BOOL,
    "stage3_module_granularity_threshold": _SIZE,
    "stage3_use_all_reduce_for_fetch_params": _BOOL,
    "stage3_allgather_sequential": _BOOL,
    "stage3_max_live_parameters": _SIZE,
    "stage3_max_reuse_distance": _SIZE,
    "stage3_prefetch_bucket_size": _SIZE,
    "stage3_param_persistence_threshold": _SIZE,
    "stage3_gather_16bit_weights_on_model_save": _BOOL,
    "stage3_gather_fp16_weights_on_model_save": _BOOL,
    "stage3_model_persistence_threshold": _SIZE,
    "zero_hpz_partition_size": _SIZE,
    "zero_quantized_weights": _BOOL,
    "zero_quantized_gradients": _BOOL,
    "memory_efficient_linear": _BOOL,
    "gather_16bit_weights_on_model_save": _BOOL,
}
# DeepSpeed's models take a field's own name as well as its ``stage3_`` alias.
ZERO_KEYS |= {key.removeprefix("stage3_"): ZERO_KEYS[key] for key in ZERO_KEYS if key.startswith("stage3_")}
ZERO_KEYS.pop("gather_fp16_weights_on_model_save")  # deprecated: only its stage3_ spelling exists
OFFLOAD_KEYS: dict[str, str | Range] = {
    "device": "none, cpu or nvme",
    "nvme_path": "path or null",
    "buffer_count": _SIZE,
    "buffer_size": _SIZE,
    "max_in_cpu": _SIZE,
    "pin_memory": _BOOL,
    "pipeline_read": _BOOL,
    "pipeline_write": _BOOL,
    "fast_init": _BOOL,
    "ratio": _FRACTION,
    "super_offload": _BOOL,
    "cpuadam_cores_perc": _FRACTION,
}


def offloads(options: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``options`` (a ``ZeroConfig.options``) that ask for parameters or optimizer
    state to be moved off the GPU, as ``zero_optimization``-relative paths, with their values."""
    asked = {
        f"{key}.device": options[key].get("device")
        for key in ("offload_optimizer", "offload_param")
        if isinstance(options.get(key), dict) and options[key].get("device", "none") not in ("none", None)
    }
    return asked | {key: True for key in ("cpu_offload", "cpu_offload_params") if options.get(key)}


def build_zero(raw: Any, where: str, *, lenient: bool = False) -> ZeroConfig:
    """The section as a ``ZeroConfig``; DeepSpeed's legacy boolean form (true = stage 1) is accepted.
    ``lenient``: DeepSpeed checks the keys besides ``stage`` itself (the deepspeed backend)."""
    if isinstance(raw, bool):
        return ZeroConfig(stage=1 if raw else 0)
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{where}: 'zero_optimization' must be an object or a boolean",
            f"found {raw!r}",
            'write e.g. "zero_optimization": {"stage": 1}',
        )
    if not lenient:
        _check_keys(raw, ZERO_KEYS, where, "zero_optimization")
    stage = int(check_number(raw.get("stage", 0), _STAGE, "zero_optimization.stage", where))
    return ZeroConfig(stage=stage, options={k: v for k, v in raw.items() if k != "stage"})


def _check_keys(raw: dict[str, Any], kinds: dict[str, str | Range], where: str, scope: str) -> None:
    reject_unknown(raw, frozenset(kinds), where, f"'{scope}'")
    for key, value in raw.items():
        _check_value(value, kinds[key], where, f"{scope}.{key}")


def _check_value(value: Any, kind: str | Range, where: str, key: str) -> None:
    if isinstance(kind, Range):
        check_number(value, kind, key, where)
    elif kind == _OFFLOAD:
        if value is not None and not isinstance(value, dict):
            _wrong(value, "an object (or null)", where, key, 'e.g. {"device": "cpu", "pin_memory": true}')
        if isinstance(value, dict):
            _check_keys(value, OFFLOAD_KEYS, where, key)
    elif kind == _OBJECT:
        if value is not None and not isinstance(value, dict):
            _wrong(value, "an object (or null)", where, key, "an object of its options")
    elif kind in (_BOOL, _OPTIONAL_BOOL):
        if not isinstance(value, bool) and not (value is None and kind == _OPTIONAL_BOOL):
            _wrong(value, kind, where, key, "true or false")
    elif kind == "path or null":
        if value is not None and not (isinstance(value, str) and value):
            _wrong(value, "a directory path (or null)", where, key, "e.g. /local_nvme")
    elif value not in ("none", "cpu", "nvme"):
        _wrong(value, f"one of {kind}", where, key, '"cpu" (or "nvme" with nvme_path)')


def _wrong(value: Any, expected: str, where: str, key: str, fix: str) -> None:
    raise ConfigError(
        f"{where}: {key} is {value!r}",
        f"DeepSpeed takes {expected} there",
        f"set {key} to {fix}",
    )
