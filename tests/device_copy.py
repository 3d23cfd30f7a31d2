"""A GPU's device-copy semantics on CPU, so that CPU tests catch code that reads the wrong tensor.

On a GPU, ``cpu_tensor.to("cuda")`` is a new tensor: a collective run on it leaves the CPU tensor as it
was. On CPU, ``t.to("cpu")`` returns ``t`` itself, so code that broadcasts ``flag.to(device)`` and then
reads ``flag`` works in every CPU test and deadlocks or diverges on the first GPU. Inside
``copying_device_moves()`` every ``Tensor.to`` that names a device returns a copy, as it would when the
device were another one; a process under test enters it before it builds its engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_original_to = torch.Tensor.to


def _names_a_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if "device" in kwargs:
        return True
    return any(isinstance(arg, torch.device | str | int | torch.Tensor) for arg in args[:1])


def _copying_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    out = _original_to(self, *args, **kwargs)
    if out is self and _names_a_device(args, kwargs):
        # a copy that keeps autograd history, like a real host-to-device move
        return out.clone() if out.requires_grad else out.detach().clone()
    return out


@contextlib.contextmanager
def copying_device_moves() -> Iterator[None]:
    """Every ``Tensor.to(device, ...)`` in this process returns a new tensor while inside."""
    torch.Tensor.to = _copying_to  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.to = _original_to  # type: ignore[method-assign]
