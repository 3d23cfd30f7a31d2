"""Mixed precision: which autocast the forward runs under, and how the loss is scaled.

fp16 keeps fp32 master weights and runs the forward under float16 autocast; its loss scaler follows
DeepSpeed's ``DynamicLossScaler`` (initial 2**initial_scale_power, halve on overflow once the
hysteresis budget is spent, double after loss_scale_window clean steps, never below
min_loss_scale) or uses a static scale when ``loss_scale`` is non-zero. bf16 needs no scaling.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from spikingsail.config.schema import BF16Config, FP16Config
from spikingsail.errors import BackendError, SailError


class Precision:
    """Full fp32: no autocast, no scaling."""

    name = "fp32"
    dtype: torch.dtype | None = None

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        torch.autograd.backward(self.scale_loss(loss))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Prepare gradients for the optimizer; True when they overflowed and the step must be skipped."""
        return False

    def update(self, overflow: bool) -> None:
        """Adjust the loss scale after a step."""

    @property
    def loss_scale(self) -> float:
        return 1.0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 itself: a GPU of compute capability 8.0 or newer.
    (``torch.cuda.is_bf16_supported()`` also says yes for older GPUs, where bf16 is emulated and
    slower than fp32.) CPUs: yes, autocast runs bf16 there."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 8


class BF16Precision(Precision):
    name = "bf16"
    dtype = torch.bfloat16

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        if not native_bf16(device):
            raise BackendError(
                f"bf16.enabled is true but {torch.cuda.get_device_name(device)} has no bfloat16 support",
                "bfloat16 needs compute capability 8.0 or newer (A100, H100, RTX 30xx and later)",
                "set bf16.enabled to false and fp16.enabled to true",
            )


class FP16Precision(Precision):
    name = "fp16"
    dtype = torch.float16

    def __init__(self, device: torch.device, config: FP16Config) -> None:
        super().__init__(device)
        self.dynamic = config.loss_scale == 0
        self.scale = 2.0**config.initial_scale_power if self.dynamic else config.loss_scale
        self.window = config.loss_scale_window
        self.min_scale = config.min_loss_scale
        self.hysteresis = config.hysteresis
        self.consecutive_hysteresis = config.consecutive_hysteresis
        self.hysteresis_left = config.hysteresis
        self.iteration = 0
        self.last_overflow = -1

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    by_device.setdefault(param.grad.device, []).append(param.grad)
        found = False
        for device, grads in by_device.items():
            found_inf = torch.zeros(1, device=device)
            inv_scale = torch.full((1,), 1.0 / self.scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            found = found or bool(found_inf.item())
        return found

    def update(self, overflow: bool) -> None:
        """DeepSpeed's ``DynamicLossScaler.update_scale``, step for step: halve on an overflow once
        the hysteresis is spent, double after ``loss_scale_window`` clean steps that follow the
        step after the last overflow, and stop the run on an overflow at ``min_loss_scale``."""
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                if self.scale == self.min_scale:
                    raise SailError(
                        f"fp16: the gradients overflowed at the minimum loss scale (fp16.min_loss_scale {self.min_scale:g})",
                        "they are not finite even at the smallest scale allowed: every further step would be skipped "
                        "(DeepSpeed stops the run here too)",
                        "look for NaN or infinite inputs or losses, lower the learning rate, or train in bf16 "
                        "(bf16.enabled) where the CPU or GPU has it",
                    )
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= 2
        self.iteration += 1

    @property
    def loss_scale(self) -> float:
        return self.scale

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "hysteresis_left": self.hysteresis_left,
            "iteration": self.iteration,
            "last_overflow": self.last_overflow,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow = int(state["last_overflow"])


def select_precision(fp16: FP16Config, bf16: BF16Config, device: torch.device) -> Precision:
    """fp16 loss scaling, bf16 autocast, or neither (the config's two sections; fp16 first)."""
    if fp16.enabled:
        return FP16Precision(device, fp16)
    if bf16.enabled:
        return BF16Precision(device)
    return Precision(device)
