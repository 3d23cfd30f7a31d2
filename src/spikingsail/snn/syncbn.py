"""Batch norm synchronised across ranks, for single-step ``[N, C, ...]`` and multi-step ``[T, N, C, ...]`` input.

``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` replaces spikingjelly's step-mode-aware batch norm
with a plain ``SyncBatchNorm``, which then reads ``[T, N, C, H, W]`` as N channels (spikingjelly
issue #393). ``convert_sync_batchnorm`` here keeps the step mode: a multi-step input is flattened
to ``[T·N, C, ...]``, so the statistics cover all T × N samples of every rank — exactly what one
process computes over the whole batch.

On GPUs the synchronisation is torch's own fused SyncBatchNorm kernel. Elsewhere (gloo on CPU,
where torch's refuses to run) the per-channel sums, sums of squares and counts are all-reduced
with the differentiable ``torch.distributed.nn.all_reduce`` in float64, so the backward is
synchronised as well.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

_ACCELERATORS = ("cuda", "hpu", "xpu")


class MultiStepSyncBatchNorm(_BatchNorm):
    """Synchronised batch norm with spikingjelly's ``step_mode`` ('s' or 'm').

    Not a ``torch.nn.SyncBatchNorm`` subclass: DDP refuses those on CPU modules, and this one also
    synchronises over gloo on CPU.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        step_mode: str = "s",
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group
        self.step_mode = step_mode

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, step_mode={self.step_mode}"  # type: ignore[no-untyped-call]

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _check_non_zero_input_channels(self, input: torch.Tensor) -> None:
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.step_mode == "m":
            if input.dim() < 3:
                raise ValueError(
                    f"multi-step batch norm expects [T, N, C, ...], got shape {tuple(input.shape)}"
                )
            steps, batch = input.shape[:2]
            out = self._forward_flat(input.flatten(0, 1))
            return out.view(steps, batch, *out.shape[1:])
        return self._forward_flat(input)

    def _forward_flat(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor
        if not (self.training and dist.is_available() and dist.is_initialized()):
            out = super().forward(x)  # plain batch norm
        elif x.device.type in _ACCELERATORS:
            # torch's fused kernels; its forward reads only attributes this class has too
            out = nn.SyncBatchNorm.forward(self, x)  # type: ignore[arg-type]
        else:
            out = self._forward_all_reduce(x)
        return out

    def _forward_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, channels] + [1] * (x.dim() - 2)
        wide = x.double()
        local = torch.cat([
            wide.sum(dims),
            (wide * wide).sum(dims),
            torch.tensor([x.numel() / channels], dtype=torch.float64, device=x.device),
        ])  # fmt: skip
        group = self.process_group or dist.group.WORLD
        total: torch.Tensor = torch.distributed.nn.all_reduce(local, group=group)  # type: ignore[no-untyped-call]
        count = total[-1]
        mean = total[:channels] / count
        var = (total[channels : 2 * channels] / count - mean * mean).clamp_min(0)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                assert self.num_batches_tracked is not None
                self.num_batches_tracked.add_(1)
                momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                unbiased = var * count / (count - 1).clamp_min(1)
                self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)
        out = (x - mean.to(x.dtype).view(shape)) * torch.rsqrt(var.to(x.dtype).view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out


def convert_sync_batchnorm(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Replace every batch-norm layer by a ``MultiStepSyncBatchNorm`` keeping its step mode and state.

    Like ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``; returns the converted module (the same
    object unless ``module`` itself is a batch-norm layer).
    """
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, MultiStepSyncBatchNorm):
        converted = MultiStepSyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            step_mode=getattr(module, "step_mode", "s"),
        )
        if module.affine:
            with torch.no_grad():
                converted.weight = module.weight
                converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, process_group))
    return converted
