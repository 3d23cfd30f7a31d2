"""Backends by name. Optional ones (DeepSpeed, FSDP2, Horovod) are imported only when chosen."""

from __future__ import annotations

import importlib

from spikingsail.backends.base import Backend
from spikingsail.errors import BackendError

# name -> "module:Class", so that choosing one backend never imports another's dependencies.
_REGISTRY: dict[str, str] = {
    "ddp": "spikingsail.backends.ddp:DDPBackend",
    "fsdp": "spikingsail.backends.fsdp:FSDPBackend",
    "deepspeed": "spikingsail.backends.deepspeed:DeepSpeedBackend",
    "horovod": "spikingsail.backends.horovod:HorovodBackend",
}

__all__ = ["Backend", "available", "backend_class", "sharding_backends"]


def available() -> list[str]:
    return sorted(_REGISTRY)


def backend_class(name: str, where: str = "<config>") -> type[Backend]:
    target = _REGISTRY.get(name.lower())
    if target is None:
        raise BackendError(
            f"{where}: sail.backend '{name}' is not a SpikingSail backend",
            fix=f"choose one of: {', '.join(available())}",
        )
    module_name, _, class_name = target.partition(":")
    cls: type[Backend] = getattr(importlib.import_module(module_name), class_name)
    return cls


def sharding_backends(stage: int) -> list[str]:
    """The backends that implement ``zero_optimization.stage`` ``stage`` (imports each to ask)."""
    return [name for name in available() if backend_class(name).max_zero_stage >= stage]
