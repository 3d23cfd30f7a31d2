"""What may differ between the run that saved a checkpoint and the run that resumes it.

A resume continues the saved run, so every setting that shapes the training must be the one it was
saved with; a difference is refused with the key, both values and what to do, never applied halfway
(the restored optimizer, scheduler and loss-scaler state would silently override most new values).
The split of ``train_batch_size`` over processes, micro-batches and accumulation may change: the engine
re-counts its micro-steps so that the next optimizer step takes the next ``train_batch_size`` samples
of the global order, whatever the split. Settings of where and how the run is kept (checkpoints,
logging, timeouts, the backend among those sharing a checkpoint format, ZeRO stage) may change freely.
A key the saved run's version did not have yet counts as saved with its default, which is what that
version did: adding a key never makes an older checkpoint refuse to resume unless the run sets it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from spikingsail.config.schema import SailConfig, keys_where
from spikingsail.errors import CheckpointError

SPLIT = keys_where("split")
"""How train_batch_size is divided: may change on a step boundary (re-counted exactly)."""
_WINDOW = (*SPLIT, "sail.backend")
"""What a save inside an accumulation window ties the resume to: its partial gradients are the
saved ranks' and micro-batches', held as the saved backend holds them (plain tensors; FSDP's are
sharded DTensors)."""
FREE = keys_where("free")
"""Keys (and sections) that change where or how the run is kept, not what it computes; the backend
only within one checkpoint format (checked separately)."""
_TIME_CHUNKS = keys_where("chunks")
"""Free unless batch norm is normalised per chunk on either side: then the chunks shape the model."""
_EXEMPT_WITHOUT_OPTIMIZER = ("optimizer",)
_UNSET = object()


def check_resumable(
    path: Path, saved: dict[str, Any], current: dict[str, Any], *, partial_window: bool, with_optimizer: bool
) -> None:
    """Raise ``CheckpointError`` naming every setting the resume cannot honour."""
    free = tuple(key for key in FREE if key != "sail.backend") if partial_window else FREE
    exempt = free + (() if with_optimizer else _EXEMPT_WITHOUT_OPTIMIZER)
    if "per_chunk" not in (_get(saved, "snn.chunk_batchnorm"), _get(current, "snn.chunk_batchnorm")):
        exempt += _TIME_CHUNKS  # exact chunks spend memory differently, they compute the same
    if not partial_window:
        exempt += SPLIT
    differences = list(_differences(saved, current, _defaults(), "", exempt))
    if not differences:
        return
    window_only = all(d.split(":", 1)[0] in _WINDOW for d in differences)
    if window_only:
        raise CheckpointError(
            f"{path} was saved inside a gradient accumulation window; this run splits the batch "
            f"differently or runs another backend ({'; '.join(differences)})",
            "the window's partial gradients belong to the micro-batches, ranks and backend that computed them",
            "resume with the saved split and backend, or from a checkpoint saved on a step boundary",
        )
    batch = (
        f'put "train_batch_size": {saved["train_batch_size"]} in the config (a resume on another number of '
        "processes keeps the global batch: the engine divides it into micro-batches and accumulation "
        "steps for this run's processes); "
        if any(d.startswith("train_batch_size:") for d in differences)
        else ""
    )
    raise CheckpointError(
        f"{path} cannot be resumed with this config: {'; '.join(differences)}",
        "a resume continues the saved run, whose optimizer, scheduler, loss scaler, data order and "
        "batch it restores; a changed setting would be overridden or would change the run halfway",
        f"{batch}set those keys back to the saved values to resume; to begin a new run from the saved "
        "weights with new settings, call engine.load_checkpoint(DIR, TAG, load_module_only=True) instead "
        "of --resume",
    )


def as_saved(config: SailConfig) -> dict[str, Any]:
    """``config`` in the form a checkpoint keeps it (``asdict`` through JSON), which resumes compare."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))  # type: ignore[no-any-return]


@functools.cache
def _defaults() -> dict[str, Any]:
    """Every key's default, as a checkpoint keeps a config."""
    return as_saved(SailConfig(train_batch_size=1, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                               world_size=1))  # fmt: skip


def _differences(
    saved: Any, current: Any, default: Any, prefix: str, exempt: tuple[str, ...]
) -> Iterator[str]:
    """``key: saved X, now Y`` for every differing key outside ``exempt``, sections compared key by
    key while both sides are sections; a key missing from the saved config counts as its default."""
    if (saved is _UNSET and current == {}) or (current is _UNSET and saved == {}):
        return  # an empty section is what a checkpoint from before the section existed has
    if saved is _UNSET and default is not _UNSET and not isinstance(default, dict):
        if default != current:
            name = prefix.rstrip(".")
            before = f"a version before {name}, which ran as its default {_show(default)}"
            yield f"{name}: saved <unset> ({before}), now {_show(current)}"
        return
    if isinstance(saved, dict) and isinstance(current, dict):
        defaults = default if isinstance(default, dict) else {}
        for key in sorted(set(saved) | set(current)):
            name = f"{prefix}{key}"
            if not _under(name, exempt):
                yield from _differences(saved.get(key, _UNSET), current.get(key, _UNSET), defaults.get(key, _UNSET),
                                        f"{name}.", exempt)  # fmt: skip
    elif saved is _UNSET and isinstance(default, dict) and isinstance(current, dict):
        # a section added since the save: each of its keys counts as saved with its default
        yield from _differences({}, current, default, prefix, exempt)
    elif saved != current:
        yield f"{prefix.rstrip('.')}: saved {_show(saved)}, now {_show(current)}"


def _show(value: Any) -> str:
    return "<unset>" if value is _UNSET else json.dumps(value)


def _under(key: str, sections: tuple[str, ...]) -> bool:
    return any(key == s or key.startswith(f"{s}.") for s in sections)


def _get(config: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(config, dict):
            return None
        config = config.get(part)  # type: ignore[assignment]
    return config
