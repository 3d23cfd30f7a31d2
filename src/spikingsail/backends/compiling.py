"""``torch.compile`` through the engine (the config's ``compile`` section): what is compiled, and
with which arguments.

Modules are compiled in place (``nn.Module.compile``), so their names, state dict and hooks stay as
they were: checkpoints of a compiled run load into an eager one and back. What each backend
compiles when ``compile.modules`` is empty is its ``compile_targets``: the module the engine calls
(DDP's wrapper, so that dynamo's DDP optimizer splits the graph at the gradient buckets), or each
block FSDP2 shards (as torchtitan does); DeepSpeed compiles the model's ``forward``, or runs its own
``engine.compile()`` for DeepCompile.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from spikingsail.config.compiling import CompileConfig
from spikingsail.errors import ConfigError


def compile_kwargs(settings: CompileConfig, where: str) -> dict[str, Any]:
    """torch.compile's keyword arguments from the section: ``kwargs`` with the named keys over it."""
    named = {"mode": settings.mode, "dynamic": settings.dynamic, "fullgraph": settings.fullgraph or None}
    named = {key: value for key, value in named.items() if value is not None}
    twice = sorted((named.keys() | {"backend"}) & settings.kwargs.keys())
    if twice:
        raise ConfigError(
            f"{where}: compile.kwargs.{twice[0]} is set, and so is compile.{twice[0]}",
            "they are the same torch.compile argument",
            f"keep compile.{twice[0]} only",
        )
    return {**settings.kwargs, **named, "backend": resolve_backend(settings.backend, where)}


def resolve_backend(name: str, where: str) -> str | Callable[..., Any]:
    """A torch.compile backend by name, or a ``module.function`` imported (DeepSpeed's rule)."""
    import torch._dynamo

    if name in torch._dynamo.list_backends(exclude_tags=()):
        return name
    module, _, function = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), function) if module else None
    except (ImportError, AttributeError):
        found = None
    if not callable(found):
        raise ConfigError(
            f"{where}: compile.backend is {name!r}, which is neither a torch.compile backend nor an "
            "importable module.function",
            f"torch.compile's backends here: {', '.join(torch._dynamo.list_backends(exclude_tags=()))}",
            'use "inductor" (the default), or the dotted path of your own backend function',
        )
    return found  # type: ignore[no-any-return]


def named_modules(model: torch.nn.Module, names: tuple[str, ...], where: str) -> list[torch.nn.Module]:
    """The submodules ``compile.modules`` names: by dotted name, or every one of a class name."""
    found: list[torch.nn.Module] = []
    for name in names:
        matches = [m for _, m in model.named_modules() if type(m).__name__ == name]
        if not matches:
            try:
                matches = [model.get_submodule(name)]
            except AttributeError:
                classes = sorted({type(m).__name__ for m in model.modules()})
                raise ConfigError(
                    f"{where}: compile.modules names {name!r}, which is neither a submodule nor a class "
                    "of a submodule of the model",
                    fix="give dotted names as model.named_modules() lists them (e.g. 'layers.0'), or "
                    f"class names: {', '.join(classes)}",
                ) from None
        found += [m for m in matches if all(m is not other for other in found)]
    return found


def compile_in_place(
    targets: list[torch.nn.Module], kwargs: dict[str, Any], where: str, *, forward_only: bool = False
) -> None:
    """``nn.Module.compile`` on each (its hooks compiled with it), or with ``forward_only`` its
    ``forward`` alone (hooks that a library registered run eagerly around it)."""
    for target in targets:
        try:
            if forward_only:
                target.forward = torch.compile(target.forward, **kwargs)
            else:
                target.compile(**kwargs)
        except (RuntimeError, ValueError, TypeError) as err:  # torch.compile checks its arguments now
            raise ConfigError(
                f"{where}: torch.compile refused the compile section's arguments: {err}",
                fix="see torch.compile's documentation for what its arguments accept together",
            ) from err
