"""Small spiking models for the SNN tests (spikingjelly, multi-step LIF with surrogate gradients)."""

from __future__ import annotations

import torch
from spikingjelly.activation_based import layer, neuron, surrogate
from torch import nn


def lif() -> nn.Module:
    return neuron.LIFNode(tau=2.0, surrogate_function=surrogate.ATan(), detach_reset=True)


def spiking_mlp(batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        layer.Linear(6, 16),
        *([layer.BatchNorm1d(16)] if batch_norm else []),
        lif(),
        layer.Linear(16, 3),
        lif(),
    )


def spiking_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        layer.Conv2d(1, 4, 3, padding=1, bias=False),
        layer.BatchNorm2d(4),
        lif(),
        layer.Flatten(),
        layer.Linear(4 * 4 * 4, 3),
        lif(),
    )


def chunkable_snn(time_steps: int, batch_norm: bool = True, elementwise_dropout: bool = True) -> nn.Module:
    """A multi-step spiking CNN whose every part splits exactly into time chunks: batch norm through
    time (one norm per step), spikingjelly's Dropout (one mask for all steps, kept as neuron-like
    state) and torch's Dropout per element (a fresh draw that a recompute must replay; on a CPU
    the chunks' draws continue one stream, as the whole step's one draw does, on CUDA they do not)."""
    torch.manual_seed(0)
    return nn.Sequential(
        layer.Conv2d(1, 4, 3, padding=1, bias=False),
        layer.BatchNormThroughTime2d(time_steps, 4) if batch_norm else nn.Identity(),
        lif(),
        layer.Dropout(0.25),
        layer.Flatten(),
        layer.SeqToANNContainer(nn.Dropout(0.1)) if elementwise_dropout else nn.Identity(),
        layer.Linear(4 * 4 * 4, 3),
        lif(),
    )
