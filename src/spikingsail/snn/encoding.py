"""Static inputs as ``[T, N, ...]`` sequences, and spike outputs back to rates.

``repeat`` (direct encoding: the same input at every step; the first layer turns it into spikes)
and ``poisson`` (rate encoding: at every step a spike with probability equal to the intensity in
[0, 1]). ``firing_rate`` averages a ``[T, N, ...]`` output over T. All keep the input's device and
dtype, so they work on the engine's device and under autocast.
"""

from __future__ import annotations

import torch


def repeat(x: torch.Tensor, time_steps: int) -> torch.Tensor:
    _check(time_steps)
    return x.unsqueeze(0).expand(time_steps, *x.shape)


def poisson(x: torch.Tensor, time_steps: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Bernoulli spikes with probability ``x`` (clamped to [0, 1]) at each of ``time_steps`` steps."""
    _check(time_steps)
    probability = x.detach().clamp(0, 1).unsqueeze(0).expand(time_steps, *x.shape)
    draws = torch.rand(probability.shape, generator=generator, device=x.device, dtype=torch.float32)
    return (draws < probability).to(x.dtype)


def encode(
    x: torch.Tensor, time_steps: int, method: str, generator: torch.Generator | None = None
) -> torch.Tensor:
    if method == "repeat":
        return repeat(x, time_steps)
    if method == "poisson":
        return poisson(x, time_steps, generator)
    raise ValueError(f"unknown encoding {method!r}: use 'repeat' or 'poisson'")


def firing_rate(spikes: torch.Tensor) -> torch.Tensor:
    """Mean over the leading time dimension of a ``[T, N, ...]`` output."""
    return spikes.mean(0)


def _check(time_steps: int) -> None:
    if time_steps < 1:
        raise ValueError(f"time_steps is {time_steps}; it must be ≥ 1")
