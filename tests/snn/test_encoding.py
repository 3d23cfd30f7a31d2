"""Static inputs as [T, N, ...] sequences and spikes back to rates."""

from __future__ import annotations

import pytest
import torch

from spikingsail.snn import encode, firing_rate, poisson, repeat


def test_repeat_is_the_input_at_every_step() -> None:
    x = torch.randn(5, 3)
    seq = repeat(x, 4)
    assert seq.shape == (4, 5, 3)
    assert all(torch.equal(seq[t], x) for t in range(4))


def test_poisson_fires_at_the_intensity() -> None:
    x = torch.tensor([0.0, 0.25, 1.0, 2.0]).expand(2000, 4)
    spikes = poisson(x, 8, torch.Generator().manual_seed(0))
    assert spikes.shape == (8, 2000, 4) and set(spikes.unique().tolist()) <= {0.0, 1.0}
    rates = firing_rate(spikes).mean(0)
    assert rates[0] == 0 and rates[2] == 1 and rates[3] == 1  # clamped to [0, 1]
    assert abs(rates[1].item() - 0.25) < 0.01


def test_encode_refuses_what_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="unknown encoding 'rate'"):
        encode(torch.ones(2), 4, "rate")
    with pytest.raises(ValueError, match="time_steps is 0"):
        repeat(torch.ones(2), 0)
