"""Importing DeepSpeed (its CPU accelerator where no GPU is visible, without MLflow), and what
``deepspeed.initialize`` raising means: an op it could not build on this node, or a model,
optimizer or config it refused. Nothing here imports DeepSpeed until it is asked to."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from spikingsail.cuda_arch_list import readable_setting, unreadable_cuda_archs
from spikingsail.errors import BackendError, first_line

INSTALL_HINT = "DS_BUILD_OPS=0 pip install 'deepspeed==0.19.8'  (or: pip install 'spikingsail[deepspeed]')"


def import_deepspeed(where: str) -> Any:
    """Import DeepSpeed (``deepspeed_without_mlflow``), choosing its CPU accelerator when no GPU is visible."""
    if "deepspeed" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        return deepspeed_without_mlflow()
    except ImportError as err:
        raise BackendError(
            f"{where}: sail.backend is deepspeed, but DeepSpeed cannot be imported",
            str(err),
            f"install it: {INSTALL_HINT}",
        ) from None


def deepspeed_without_mlflow() -> Any:
    """``import deepspeed``, without MLflow: DeepSpeed's autotuner imports MLflow where it is
    installed, to log tuning runs (which the ``deepspeed --autotuning`` launcher does, not a training
    process), a second of each rank's start. Unless the process has imported MLflow itself, DeepSpeed
    imports as where it is not installed; the script's own ``import mlflow`` afterwards is unaffected."""
    with _without("mlflow"):
        import deepspeed
    return deepspeed


@contextlib.contextmanager
def _without(module: str) -> Iterator[None]:
    """``import module`` fails meanwhile, unless the process has imported it already."""
    if module in sys.modules:
        yield
        return
    sys.modules[module] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if module in sys.modules and sys.modules[module] is None:
            del sys.modules[module]


def initialize_error(source: str, err: BaseException, device: torch.device) -> BackendError:
    """What ``deepspeed.initialize`` raising ``err`` means: an op it could not build (a compiler
    or ``TORCH_CUDA_ARCH_LIST`` problem of the node), else a model, optimizer or config it refused."""
    op = _op_being_built(err)
    if op is None:
        return BackendError(
            f"{source}: deepspeed.initialize refused the model, optimizer or config",
            _describe(err),
            "fix the config key or argument named above (DeepSpeed's config reference: "
            "https://www.deepspeed.ai/docs/config-json/)",
        )
    avoid = ""
    if op in ("fused_adam", "cpu_adam"):
        avoid = (
            '; or avoid the op: "optimizer": {"params": {"torch_adam": true}} in the config is torch\'s AdamW'
        )
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    unreadable = unreadable_cuda_archs(arch_list)
    if device.type == "cuda" and arch_list and unreadable:
        return BackendError(
            f"{source}: DeepSpeed cannot build its {op} op for TORCH_CUDA_ARCH_LIST={arch_list!r}",
            f"its op builder reads each entry as MAJOR.MINOR[+PTX] and cannot read "
            f"{', '.join(map(repr, unreadable))}, a form only torch accepts ({_describe(err)})",
            f"start the job with {readable_setting(arch_list, or_unset=True)}{avoid}",
        )
    return BackendError(
        f"{source}: DeepSpeed could not build its {op} op on this node",
        _describe(err),
        "`sail doctor` says whether this node can compile DeepSpeed's ops (a C++ compiler; nvcc and "
        "CUDA_HOME on a GPU node); on a GPU node, FusedAdam and CPU Adam can be pre-built once: "
        f"SAIL_DEEPSPEED_CUDA_OPS=1 bash scripts/setup.sh --backends{avoid}",
    )


def _op_being_built(err: BaseException) -> str | None:
    """The name of the DeepSpeed op whose builder ``err`` (or an exception it chains) came from."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            if f"{os.sep}op_builder{os.sep}" in tb.tb_frame.f_code.co_filename:
                builder = tb.tb_frame.f_locals.get("self")
                return str(getattr(builder, "name", None) or Path(tb.tb_frame.f_code.co_filename).stem)
            tb = tb.tb_next
        current = current.__cause__ or current.__context__
    return None


def _describe(err: BaseException) -> str:
    """One line; for DeepSpeed's pydantic config models, the key path, the complaint and the value."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        with contextlib.suppress(Exception):
            model = getattr(err, "title", "the config")
            return f"{model}: " + "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']} (found {e.get('input')!r})" for e in errors()
            )
    return f"{type(err).__name__}: {first_line(err)}"
