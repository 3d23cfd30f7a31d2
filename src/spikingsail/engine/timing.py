"""Timestamps of this rank's own work: a clock that is right on a GPU, and the moment a backward's
last gradient is ready (what follows it is the wait for the other ranks)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn


class Clock:
    """Wall-clock marks on a CPU; CUDA events on a GPU, where the host runs ahead of the kernels."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return float(start.elapsed_time(end)) / 1000.0
        return float(end - start)


class LastGradient:
    """When this rank's own work in a backward ends: a ``post_accumulate_grad`` hook on every
    parameter marks each gradient as it is ready, so the last mark is the end of the rank's
    compute; whatever backward takes after it (DDP's and Horovod's all-reduce finishing) is the
    wait for the slowest rank's gradients."""

    def __init__(self, model: nn.Module, clock: Clock) -> None:
        self.clock = clock
        self._in_backward = False
        self.mark: Any = None
        self._handles = [
            p.register_post_accumulate_grad_hook(self._ready)  # type: ignore[no-untyped-call]
            for p in model.parameters()
            if p.requires_grad
        ]

    def _ready(self, _param: torch.Tensor) -> None:
        if self._in_backward:
            self.mark = self.clock.mark()

    def begin(self) -> None:
        self._in_backward, self.mark = True, None

    def end(self) -> Any:
        """The last gradient's mark, or None when nothing in the backward needed one."""
        self._in_backward = False
        return self.mark

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
