"""Spiking neural networks: neuron-state hygiene, multi-step encoding, multi-step SyncBatchNorm."""

from spikingsail.snn.adapters import SpikingAdapter, find_adapter, register_adapter
from spikingsail.snn.encoding import encode, firing_rate, poisson, repeat
from spikingsail.snn.syncbn import MultiStepSyncBatchNorm, convert_sync_batchnorm

__all__ = [
    "MultiStepSyncBatchNorm",
    "SpikingAdapter",
    "convert_sync_batchnorm",
    "encode",
    "find_adapter",
    "firing_rate",
    "poisson",
    "register_adapter",
    "repeat",
]
