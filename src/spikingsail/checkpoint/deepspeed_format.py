"""Where a SpikingSail checkpoint keeps DeepSpeed's own, and how its files are read safely: facts
of the checkpoint format that the deepspeed backend writes and ``export`` reads back."""

from __future__ import annotations

from typing import Any

from spikingsail.checkpoint import dcp_io

STATE_TAG = "deepspeed"
"""The tag of DeepSpeed's checkpoint inside a SpikingSail checkpoint's ``state/`` directory."""


def _safe_globals() -> list[Any]:
    """The non-tensor classes DeepSpeed's own checkpoints contain (loss scalers and enums)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_torch_load(path: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load`` with ``weights_only=True`` whatever the caller asks (DeepSpeed's own readers ask
    for full unpickling, which would let a checkpoint directory run code), DeepSpeed's loss scalers
    and enums allowed; failures as ``CheckpointError``."""
    return dcp_io.load_weights_only(
        path, map_location, allowed_globals=_safe_globals(),
        holds="tensors, plain data and DeepSpeed's loss scaler", **kwargs,
    )  # fmt: skip
