"""Which of spikingjelly's neuron kernels run on a CUDA device (``snn.backend``).

spikingjelly 2.0 gives every neuron kind (IF, LIF, PLIF, …) one operator with several CUDA
implementations: its native CUDA kernels (built from source with ``SJ_BUILD_NATIVE_CUDA=1``), Triton
kernels, and the torch reference ops. It picks one per kind and device from the environment variable
``SJ_<KIND>_CUDA_IMPLEMENTATION`` (``auto``, ``cuda``, ``triton`` or ``torch``), read when the
kind's operator is imported; ``auto`` tries cuda, then triton, then torch. On a CPU it always runs
the torch reference.

``snn.backend`` sets that choice from the config, for every neuron kind of this process:

* ``"auto"`` — spikingjelly's own choice: each kind's variable where the environment sets it, else
  the first implementation that loads;
* ``"torch"``, ``"cuda"``, ``"triton"`` — that implementation for every kind. The engine refuses,
  before the first step, a setting the device cannot run: a fused kernel on a CPU, Triton that is not
  installed, native kernels that were not built (or not for this GPU), and a variable of the
  environment that asks for another implementation (one fact, one source);
* ``"cupy"`` (spikingjelly 0.0.0.0.x's fused kernels) is refused: 2.0 replaced them with ``"cuda"``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

import torch

from spikingsail.errors import ConfigError

_OPS = "spikingjelly._ops"


def selections(imported_only: bool = False) -> list[Any]:
    """spikingjelly's implementation choice (``_CudaSelection``) of every neuron kind, importing each
    kind's operator package (which imports inductor: seconds) so that none is left to read the
    environment later; or of the kinds whose package is imported already."""
    if imported_only and f"{_OPS}.selection" not in sys.modules:
        return []
    choices = importlib.import_module(f"{_OPS}.selection")
    found = []
    for namespace in getattr(choices, "_NEURON_NAMESPACES", ()):
        kind = namespace.removeprefix("sj_")
        for package in (f"{_OPS}.{kind}", f"{_OPS}.{kind}_"):  # "if" is a keyword: its package is "if_"
            if package in sys.modules or (not imported_only and importlib.util.find_spec(package)):
                selection = getattr(importlib.import_module(package), "_selection", None)
                if isinstance(selection, choices._CudaSelection):
                    found.append(selection)
                break
    return found


def select(backend: str, device: torch.device, source: str) -> None:
    """Make ``backend`` spikingjelly's implementation for every neuron kind on ``device``. Raises
    ``ConfigError`` for a setting this device cannot run, leaving spikingjelly's choice as it was."""
    where = f"{source}: snn.backend is {backend!r}"
    if backend == "cupy":
        raise ConfigError(
            f"{where}, but spikingjelly {_version()} has no CuPy kernels",
            "spikingjelly 2.0 replaced the neurons' cupy backend with its native CUDA kernels and Triton ones",
            'set snn.backend to "cuda" (native kernels) or "triton"; "auto" takes the first that loads',
        )
    if backend != "auto" and device.type != "cuda" and backend != "torch":
        raise ConfigError(
            f"{where}, but the engine's device is {device}",
            "spikingjelly's fused neuron kernels run on NVIDIA CUDA devices; on a CPU it runs the torch "
            "reference ops",
            'run on a GPU, or set snn.backend to "torch" or "auto"',
        )
    found = selections(imported_only=backend == "auto")
    known = all(hasattr(s, "_requested") and hasattr(s, "_selections") for s in found)
    if backend == "auto" and not (found and known):
        return  # nothing chosen yet, or another spikingjelly: its own choice stands
    if not found or not known:
        raise ConfigError(
            f"{where}, but spikingjelly {_version()} chooses its neuron kernels in a way this "
            "SpikingSail does not know",
            "snn.backend sets spikingjelly 2.0's per-neuron implementation choice",
            'install spikingjelly 2.0, or set snn.backend to "auto" and choose with spikingjelly\'s own '
            "SJ_<KIND>_CUDA_IMPLEMENTATION variables",
        )
    for selection in found:
        variable = selection._environment_variable
        asked = os.environ.get(variable)
        if backend != "auto" and asked not in (None, "auto", backend):
            raise ConfigError(
                f"{where}, but the environment sets {variable}={asked}",
                "both choose the implementation of the same neuron kind, and would disagree",
                f'unset {variable}, or set snn.backend to {asked!r} (or "auto", which follows the variable)',
            )
    before = [s._requested for s in found]
    for selection in found:  # spikingjelly's choice as its import would make it, with this variable
        _request(
            selection,
            os.environ.get(selection._environment_variable, "auto") if backend == "auto" else backend,
        )
    if device.type == "cuda" and backend in ("cuda", "triton"):
        try:
            _check_loads(found, backend, device, where)
        except ConfigError:
            for selection, requested in zip(found, before, strict=True):
                _request(selection, requested)
            raise


def _request(selection: Any, implementation: str) -> None:
    if selection._requested != implementation:
        with selection._lock:
            selection._requested = implementation
            selection._selections.clear()  # the choices made under the old request
            selection._compiled_selections.clear()


def _check_loads(found: list[Any], backend: str, device: torch.device, where: str) -> None:
    """Every kind's ``backend`` implementation must load on ``device`` (spikingjelly's own check)."""
    failed = {}
    for selection in found:
        try:
            selection.diagnostics(device)
        except RuntimeError as error:
            failed[selection._namespace.removeprefix("sj_")] = str(error)
    if not failed:
        return
    reason = next(iter(failed.values()))
    fix = (
        "install Triton (pip install triton; torch's CUDA wheels bring it)"
        if backend == "triton"
        else "build spikingjelly's native kernels for this GPU (pip install from source with "
        "SJ_BUILD_NATIVE_CUDA=1 --no-build-isolation, TORCH_CUDA_ARCH_LIST naming this GPU)"
    )
    raise ConfigError(
        f"{where}, but it does not load on {device} ({torch.cuda.get_device_name(device)}) for the "
        f"neuron kind(s) {', '.join(sorted(failed))}",
        f"spikingjelly says: {reason}",
        f'{fix}, or set snn.backend to "auto" (the first implementation that loads)',
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("spikingjelly")
    except PackageNotFoundError:
        return "(version unknown)"
