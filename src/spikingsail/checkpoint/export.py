"""The trained model out of a run: one consolidated state dict, from the live engine or a checkpoint.

``write_model`` writes a ``{name: tensor}`` state dict as ``.safetensors`` (the ``safetensors``
package) or as a torch file (``.pt``, ``.pth``, ``.bin``), atomically: a temporary file, fsynced,
renamed into place, so that a crash never leaves half a model under the final name.

``read_model`` reads the model's weights back out of a SpikingSail checkpoint without a process
group or GPU, whatever backend wrote it: DCP checkpoints (ddp, ZeRO-1/2 on ddp, fsdp, horovod) are
reassembled from every rank's shards by DCP's reader with no process group; DeepSpeed checkpoints
go through DeepSpeed's own ``zero_to_fp32`` (ZeRO stages 1-3: the fp32 master weights from every
rank's optimizer partition), with its ``torch.load`` calls restricted to weights.

``describe`` lists what a checkpoint directory holds (``sail checkpoint ls``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from spikingsail.checkpoint import dcp_io
from spikingsail.checkpoint.store import MANIFEST, CheckpointStore, replace_durably
from spikingsail.errors import CheckpointError, first_line

log = logging.getLogger(__name__)

SAFETENSORS = ".safetensors"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_output_path(path: str | Path) -> Path:
    """The output file, checked before any work: a known suffix and a writable directory."""
    out = Path(path)
    if out.suffix not in (SAFETENSORS, *TORCH_SUFFIXES):
        raise CheckpointError(
            f"cannot tell the format of {out}",
            f"the file name ends in {out.suffix or 'nothing'}",
            f"name it *{SAFETENSORS} (safetensors) or *.pt / *.pth / *.bin (torch.save)",
        )
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise CheckpointError(f"cannot write {out}", f"{parent} is not a directory", "create it first")
    if not os.access(parent, os.W_OK):
        raise CheckpointError(f"cannot write {out}", f"{parent} is not writable", "choose another place")
    return out


def cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors in ``dtype``, on the CPU, contiguous and unshared; others as they are."""
    out = {}
    for name, tensor in state.items():
        value = tensor.detach().to("cpu")
        if value.is_floating_point():
            value = value.to(dtype)
        out[name] = value.contiguous().clone()
    return out


def write_model(state: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str]) -> Path:
    """Write ``state`` to ``path`` (format by suffix), atomically."""
    out = check_output_path(path)
    temporary = out.with_name(f".{out.name}.tmp")
    try:
        if out.suffix == SAFETENSORS:
            from safetensors.torch import save_file

            save_file(state, str(temporary), metadata=metadata)
        else:
            torch.save(state, temporary)
        replace_durably(temporary, out)
    except OSError as err:
        raise CheckpointError(
            f"could not write {out}", first_line(err), "check free space and permissions"
        ) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
    return out


def model_metadata(backend: str, global_steps: object, **extra: str) -> dict[str, str]:
    """What a model file says of where it came from (safetensors' string metadata)."""
    from spikingsail import __version__

    return {"format": "pt", "saved_by": f"spikingsail {__version__}", "backend": backend,
            "global_steps": str(global_steps), **extra}  # fmt: skip


def read_saved_model(path: str | Path) -> dict[str, torch.Tensor]:
    """A model file written by ``write_model`` (either format), read safely."""
    path = Path(path)
    if path.suffix == SAFETENSORS:
        from safetensors.torch import load_file

        return dict(load_file(str(path)))
    loaded: dict[str, torch.Tensor] = torch.load(path, map_location="cpu", weights_only=True)
    return loaded


# -- reading a checkpoint ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointInfo:
    tag: str
    path: Path
    global_steps: int
    world_size: int
    backend: str
    state_format: str
    size_bytes: int
    created: float
    latest: bool


def describe(directory: str | Path) -> list[CheckpointInfo]:
    """The complete checkpoints of ``directory``, oldest first (``sail checkpoint ls``)."""
    store = CheckpointStore(directory)
    if not store.root.is_dir():
        raise CheckpointError(f"{store.root} is not a directory", fix="give the --checkpoints-path of a run")
    latest = store.latest()
    found = []
    for tag in store.tags():
        path = store.root / tag
        manifest = store.metadata(tag)
        files = manifest.get("files", {})
        engine = _engine_file(path)
        found.append(CheckpointInfo(
            tag=tag, path=path, global_steps=int(manifest.get("global_steps", -1)),
            world_size=int(manifest.get("world_size", -1)), backend=str(engine.get("backend", "?")),
            state_format=str(engine.get("state_format", "dcp")),
            size_bytes=sum(int(entry["size"]) for entry in files.values()),
            created=float(manifest.get("created", 0.0)), latest=tag == latest,
        ))  # fmt: skip
    return found


def read_model(directory: str | Path, tag: str | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's weights in a checkpoint (``tag``, or the latest that verifies), verified first.

    Returns (state dict on the CPU in the saved dtypes, what ``engine.pt`` says of the run)."""
    store = CheckpointStore(directory)
    chosen = store.resolve(tag)  # verified against its manifest
    path = store.root / chosen
    engine = _engine_file(path)
    state_format = str(engine.get("state_format", "dcp"))
    if state_format == "dcp":
        state = _read_dcp_model(path / "state")
    elif state_format == "deepspeed":
        state = _read_deepspeed_model(path / "state", engine)
    else:
        raise CheckpointError(f"{path} holds {state_format} state, which this version cannot read",
                              fix="export it with the SpikingSail version that wrote it")  # fmt: skip
    engine["tag"] = chosen
    return state, engine


def _engine_file(path: Path) -> dict[str, Any]:
    try:
        loaded: dict[str, Any] = torch.load(path / "engine.pt", map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path / 'engine.pt'} is missing",
                              f"{path} is not a SpikingSail checkpoint") from None  # fmt: skip
    except Exception as err:  # torch raises several types for damaged files
        raise CheckpointError(f"cannot read {path / 'engine.pt'}", first_line(err),
                              "the checkpoint is damaged; use another tag") from None  # fmt: skip
    return loaded


def _read_dcp_model(directory: Path) -> dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of a DCP checkpoint, whole, read in this one process (DCP's reader
    reassembles each tensor from the shards the ranks wrote)."""
    reader = dcp_io.SafeFileSystemReader(directory)
    saved = reader.read_metadata().state_dict_metadata
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in saved.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}  # fmt: skip
    if not state:
        raise CheckpointError(f"{directory} holds no model tensors", fix="use another checkpoint")
    try:
        with dcp_io._single_process_is_intended(None):
            dcp_load(state, storage_reader=reader, planner=dcp_io.SafeLoadPlanner(), no_dist=True)
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"cannot read the model in {directory}", dcp_io.describe(err),
                              "the files are damaged; use another checkpoint") from None  # fmt: skip
    return {key.removeprefix("model."): value for key, value in state.items()}


def _read_deepspeed_model(directory: Path, engine: dict[str, Any]) -> dict[str, torch.Tensor]:
    """DeepSpeed's checkpoint under ``state/`` (tag ``STATE_TAG``): ZeRO 1-3 through DeepSpeed's
    ``zero_to_fp32`` (fp32 master weights); stage 0 from the model file."""
    from spikingsail.backends.deepspeed import STATE_TAG

    config = json.loads(engine.get("config", "{}"))
    stage = int(config.get("zero_optimization", {}).get("stage", 0))
    ds_dir = directory / STATE_TAG
    try:
        from deepspeed.utils import zero_to_fp32
    except ImportError:
        raise CheckpointError(
            f"{directory.parent} was written by the deepspeed backend; reading it needs DeepSpeed",
            "its ZeRO partitions are in DeepSpeed's own format",
            "pip install deepspeed (scripts/setup.sh --backends), then export again",
        ) from None
    try:
        with _weights_only_loads(zero_to_fp32):
            if stage == 0:
                files = sorted(ds_dir.glob("mp_rank_*_model_states.pt"))
                if not files:
                    raise CheckpointError(f"{ds_dir} has no mp_rank_*_model_states.pt",
                                          fix="use another checkpoint")  # fmt: skip
                module: dict[str, torch.Tensor] = zero_to_fp32.torch.load(files[0], map_location="cpu")[
                    "module"
                ]
                return dict(module)
            lazy = zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint(str(ds_dir), False)
            return dict(zero_to_fp32.to_torch_tensor(lazy))
    except CheckpointError:
        raise
    except Exception as err:  # DeepSpeed's reader raises assorted types for damaged or foreign files
        raise CheckpointError(
            f"DeepSpeed could not consolidate the ZeRO stage {stage} checkpoint in {ds_dir}",
            f"{type(err).__name__}: {first_line(err)}",
            "the files are damaged; use another checkpoint",
        ) from None


@contextlib.contextmanager
def _weights_only_loads(module: types.ModuleType) -> Iterator[None]:
    """Run ``module``'s ``torch.load`` calls with ``weights_only=True`` (plus DeepSpeed's own
    loss-scaler and enum classes): DeepSpeed's reader asks for full unpickling, which would let a
    checkpoint directory run code."""
    from spikingsail.backends.deepspeed import safe_torch_load

    real = getattr(module, "torch")  # noqa: B009

    class _Torch(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        load = staticmethod(safe_torch_load)

    setattr(module, "torch", _Torch("torch"))  # noqa: B010 (the module's global, for its own calls)
    try:
        yield
    finally:
        setattr(module, "torch", real)  # noqa: B010


__all__ = [
    "DTYPES",
    "MANIFEST",
    "CheckpointInfo",
    "cast",
    "check_output_path",
    "describe",
    "model_metadata",
    "read_model",
    "read_saved_model",
    "write_model",
]
