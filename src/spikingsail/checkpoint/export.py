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
import errno
import json
import logging
import math
import os
import resource
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from spikingsail.checkpoint import dcp_io
from spikingsail.checkpoint.checkpointer import Beat, Steps, on_rank_zero
from spikingsail.checkpoint.deepspeed_format import STATE_TAG, safe_torch_load
from spikingsail.checkpoint.engine_state import TrainingState
from spikingsail.checkpoint.faults import filesystem
from spikingsail.checkpoint.store import MANIFEST, CheckpointStore, replace_durably
from spikingsail.errors import CheckpointError, SailError, first_line
from spikingsail.monitor.hangwatch import CHECKPOINT
from spikingsail.mounts import free_bytes

log = logging.getLogger(__name__)

SAFETENSORS = ".safetensors"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def save_live_model(
    training: TrainingState, path: str | Path, dtype: torch.dtype, *, steps: Steps, beat: Beat
) -> str | None:
    """``engine.save_model``: gather the model's state through its backend on every rank, and write
    it on rank 0 (its path there, None elsewhere). The output path is checked first, on rank 0, and
    a refusal stops every rank before the gather."""
    if dtype not in DTYPES.values():
        raise SailError(f"save_model(dtype={dtype}): not a floating dtype a model is saved in",
                        fix="use torch.float32, torch.bfloat16 or torch.float16")  # fmt: skip
    rank_info = training.rank_info
    on_rank_zero(lambda: check_output_path(path), rank_info)
    beat.enter(CHECKPOINT)
    state = training.backend.consolidated_state_dict(training.module)
    beat.leave(steps.global_steps, steps.micro_steps)

    def write() -> str:
        written = str(
            write_model(cast(state, dtype), path, model_metadata(training.backend.name, steps.global_steps))
        )
        log.info("model saved: %s (%d tensors, %s)", written, len(state), str(dtype).removeprefix("torch."))
        return written

    written = on_rank_zero(write, rank_info)
    return written if rank_info.is_rank_zero else None


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
    except Exception as err:  # torch.save and safetensors report a failed write without an OSError
        raise _write_error(out, state, err) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
    return out


def _write_error(out: Path, state: dict[str, torch.Tensor], err: Exception) -> CheckpointError:
    """Why writing ``out`` failed, in words: a full disk and a file size limit are told apart from
    the free space (torch.save says "basic_ios::clear" or "unexpected pos", safetensors "No space
    left on device" or nothing, with no errno)."""
    code = next((e.errno for e in _causes(err) if isinstance(e, OSError) and e.errno), None)
    needed = sum(t.numel() * t.element_size() for t in state.values())
    free = free_bytes(out.parent)
    detail = f"{type(err).__name__}: {first_line(err)}"
    if code in (errno.ENOSPC, errno.EDQUOT) or (code is None and free is not None and free < needed):
        room = "" if free is None else f"; {free / 1e6:.1f} MB are free on {filesystem(out.parent)}"
        return CheckpointError(f"could not write {out}: the disk is full",
                               f"the model takes about {needed / 1e6:.1f} MB{room} ({detail})",
                               "free space there, or write the model to another filesystem")  # fmt: skip
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if code == errno.EFBIG or (code is None and limit != resource.RLIM_INFINITY and limit < needed):
        shown = "" if limit == resource.RLIM_INFINITY else f" of {limit / 1e6:.1f} MB"
        return CheckpointError(f"could not write {out}: the file would exceed the file size limit{shown}",
                               f"the model takes about {needed / 1e6:.1f} MB ({detail})",
                               "raise the limit (ulimit -f), or write the model in a smaller dtype")  # fmt: skip
    return CheckpointError(f"could not write {out}", detail, "check free space and permissions there")


def _causes(err: BaseException) -> Iterator[BaseException]:
    seen: BaseException | None = err
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


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
    problem: str = ""
    """Why the checkpoint cannot be read (its manifest or engine.pt is damaged); "" when it can."""


def describe(directory: str | Path) -> list[CheckpointInfo]:
    """The complete checkpoints of ``directory``, oldest first (``sail checkpoint ls``); a damaged
    one is listed with its ``problem``, not skipped."""
    store = CheckpointStore(directory)
    if not store.root.is_dir():
        raise CheckpointError(f"{store.root} is not a directory", fix="give the --checkpoints-path of a run")
    latest = store.latest()
    found = []
    for tag in store.tags():
        path = store.root / tag
        try:
            manifest = store.metadata(tag)
            engine = _engine_file(path)
        except CheckpointError as err:
            found.append(CheckpointInfo(tag=tag, path=path, global_steps=-1, world_size=-1, backend="?",
                                        state_format="?", size_bytes=-1, created=path.stat().st_mtime,
                                        latest=tag == latest, problem=_told(err)))  # fmt: skip
            continue
        found.append(CheckpointInfo(
            tag=tag, path=path, global_steps=manifest.get("global_steps", -1),
            world_size=manifest.get("world_size", -1), backend=engine.get("backend", "?"),
            state_format=engine.get("state_format", "dcp"),
            size_bytes=sum(entry["size"] for entry in manifest["files"].values()),
            created=float(manifest.get("created", path.stat().st_mtime)), latest=tag == latest,
        ))  # fmt: skip
    return found


def _told(err: CheckpointError) -> str:
    """What is wrong and why, on one line."""
    return f"{err.what} ({err.why})" if err.why else err.what


def read_model(directory: str | Path, tag: str | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's weights in a checkpoint (``tag``, or the latest that verifies), verified first.

    Returns (state dict on the CPU in the saved dtypes, what ``engine.pt`` says of the run)."""
    store = CheckpointStore(directory)
    chosen = store.resolve(tag, check=_engine_file)  # verified against its manifest, engine.pt read
    path = store.root / chosen
    engine = _engine_file(path)
    state_format = engine.get("state_format", "dcp")
    if state_format == "dcp":
        state = _read_dcp_model(path / "state")
    else:  # "deepspeed": _engine_file knows no other
        state = _read_deepspeed_model(path / "state", engine)
    engine["tag"] = chosen
    return state, engine


def _engine_file(path: Path) -> dict[str, Any]:
    """``engine.pt``, read weights-only and checked: the keys this module reads, of their types."""
    try:
        loaded = torch.load(path / "engine.pt", map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path / 'engine.pt'} is missing",
                              f"{path} is not a SpikingSail checkpoint") from None  # fmt: skip
    except Exception as err:  # torch raises several types for damaged files
        raise CheckpointError(f"cannot read {path / 'engine.pt'}", first_line(err),
                              "the checkpoint is damaged; use another tag") from None  # fmt: skip
    problem = _engine_problem(loaded) or _state_problem(path, loaded)
    if problem:
        raise CheckpointError(f"{path / 'engine.pt'} is not a SpikingSail engine file", problem,
                              "the checkpoint is damaged; use another tag")  # fmt: skip
    engine: dict[str, Any] = loaded
    return engine


_ENGINE_TYPES: dict[str, type[Any]] = {"backend": str, "state_format": str, "config": str,
                                       "global_steps": int, "world_size": int}  # fmt: skip


def _engine_problem(loaded: Any) -> str | None:
    if not isinstance(loaded, dict):
        return f"it holds a {type(loaded).__name__}, not a dict"
    for key, kind in _ENGINE_TYPES.items():
        value = loaded.get(key, kind())
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"its {key!r} is {value!r}, not a {kind.__name__}"
    try:
        config = json.loads(loaded.get("config", "{}"))
    except (ValueError, RecursionError) as err:
        return f"its 'config' is not JSON ({first_line(err)})"
    zero = config.get("zero_optimization", {}) if isinstance(config, dict) else None
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if not isinstance(stage, int | float) or isinstance(stage, bool) or not math.isfinite(stage):
        return "its 'config' is not a config with a ZeRO stage"
    return None


def _state_problem(path: Path, engine: dict[str, Any]) -> str | None:
    """Whether ``state/`` holds the format engine.pt names (a reader of the other would fail deep inside)."""
    state_format = engine.get("state_format", "dcp")
    if state_format == "dcp":
        found = (path / "state" / dcp_io.METADATA).is_file()
    elif state_format == "deepspeed":
        found = (path / "state" / STATE_TAG).is_dir()
    else:
        return f"it names {state_format!r} state, which this version cannot read (dcp or deepspeed)"
    return None if found else f"it names {state_format} state, which {path / 'state'} does not hold"


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
    config = json.loads(engine.get("config", "{}"))  # checked by _engine_file
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
