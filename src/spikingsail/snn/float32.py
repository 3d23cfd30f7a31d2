"""Full float32 for a while: autocast and TF32 off, cuDNN's algorithm fixed, all put back after.

torch has two ways to set TF32: the legacy flags (``torch.backends.cuda.matmul.allow_tf32``,
``cudnn.allow_tf32``, ``torch.set_float32_matmul_precision``) and, since 2.9, a precision per backend
and operator (``torch.backends.cuda.matmul.fp32_precision`` and the rest). Once a process has set
the new ones, the legacy readers raise (they cannot say one value for several), and ``cudnn.flags``
cannot put its old flags back. So where the new settings exist, they are the ones read, set and put
back, each by itself; the legacy calls run only on a torch without them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

# (backend, operator) pairs with an ``fp32_precision`` of their own in torch >= 2.9
_OPERATORS = (
    ("cuda", "matmul"),
    ("cudnn", "conv"),
    ("cudnn", "rnn"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
)


def _operators() -> list[Any]:
    found = []
    for backend, operator in _OPERATORS:
        holder = getattr(getattr(torch.backends, backend, None), operator, None)
        if holder is None or not hasattr(holder, "fp32_precision"):
            return []  # a torch before the per-operator settings: the legacy flags below
        found.append(holder)
    return found


@contextlib.contextmanager
def float32_exact(device_type: str) -> Iterator[None]:
    """Autocast off, every float32 matmul and convolution in full float32, cuDNN deterministic."""
    cudnn = torch.backends.cudnn
    operators = _operators()
    with torch.autocast(device_type, enabled=False):
        if not operators:
            precision = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("highest")
            try:
                with cudnn.flags(
                    enabled=cudnn.enabled, benchmark=False, deterministic=True, allow_tf32=False
                ):
                    yield
            finally:
                torch.set_float32_matmul_precision(precision)
            return
        before = [holder.fp32_precision for holder in operators]
        benchmark, deterministic = cudnn.benchmark, cudnn.deterministic
        try:
            for holder in operators:
                holder.fp32_precision = "ieee"
            cudnn.benchmark, cudnn.deterministic = False, True
            yield
        finally:
            for holder, precision in zip(operators, before, strict=True):
                holder.fp32_precision = precision
            cudnn.benchmark, cudnn.deterministic = benchmark, deterministic
