"""What each rank saves of its own, beside the state its backend writes: its random streams, the
partial gradients of an accumulation window in progress, and its own buffers (batch norms that are
not synchronised). ``engine_state`` writes them per rank and reads them back."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


def restore_grads(module: torch.nn.Module, grads: dict[str, torch.Tensor | None]) -> None:
    """Put the gradients of a window in progress back, each on its parameter's device (they were
    read onto the CPU)."""
    for name, param in module.named_parameters():
        grad = grads.get(name)
        param.grad = None if grad is None else grad.to(param.device, non_blocking=True)


def restore_buffers(module: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Put back the buffers this rank had when it saved (its own batch-norm statistics)."""
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])


def capture_rng(device: torch.device) -> dict[str, Any]:
    """The random streams this rank draws from: Python, NumPy, torch's CPU generator, and the
    generator of the rank's own GPU (not every visible GPU's: another job shape may see fewer, or
    give this rank another index)."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                  "position": int(position), "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }  # fmt: skip
    if device.type == "cuda":
        state["cuda_device"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Restore what ``capture_rng`` saved; the saved GPU stream goes to this rank's own device,
    whatever its index now."""
    random.setstate(state["python"])
    numpy = state["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state((numpy["kind"], keys, numpy["position"], numpy["has_gauss"], numpy["cached"]))
    torch.set_rng_state(state["torch"])
    if device.type != "cuda":
        return
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"], device)
    elif "cuda" in state:  # written by earlier versions: every visible GPU's stream, by index
        saved = state["cuda"]
        own = saved[device.index or 0] if (device.index or 0) < len(saved) else None
        if own is None:
            log.warning("the checkpoint has no random state for GPU %s; its stream starts afresh", device)
        else:
            torch.cuda.set_rng_state(own, device)
