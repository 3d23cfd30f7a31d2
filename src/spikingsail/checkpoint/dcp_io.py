"""Model and optimizer state through ``torch.distributed.checkpoint`` (DCP), read back safely.

DCP keys the state by parameter name (no ``module.`` prefix, optimizer state by name rather than
by position), spreads the writing of replicated tensors over the ranks, reshards on load (any
world size, and sharded backends later) and can write in the background (``async_save``).

DCP itself unpickles its ``.metadata`` file and the non-tensor values with plain ``pickle``,
which would let a checkpoint directory run code. Here the metadata goes through an unpickler
that knows only DCP's own metadata classes, and non-tensor values through
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import enum
import io
import pickle
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from spikingsail.errors import CheckpointError, first_line

METADATA = ".metadata"
_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


# Optimizer state flattened to one key per parameter and value ("state.<name>.exp_avg",
# "param_groups.<name>.lr"), as torchtitan keeps it: an optimizer that holds only some of the
# parameters (ZeRO-1's shard of them) writes and reads exactly its own keys, and the union of the
# ranks' keys is the whole optimizer, loadable by any backend.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True, strict=True)


def state_to_save(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` keyed by parameter name.

    An optimizer that has not stepped yet has no state; it is left out rather than given one
    (torch would initialise it by stepping with zero gradients, which changes later updates).
    """
    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    if optimizer.state:
        state["optimizer"] = get_optimizer_state_dict(module, optimizer, options=_FLAT)
    return state


def full_model_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict, sharded (FSDP) parameters gathered, on rank 0's CPU; the other
    ranks of a process group get an empty dict. Collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=dist.is_initialized())
    state = get_model_state_dict(module, options=options)
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def _writer(directory: Path) -> FileSystemWriter:
    # One writer thread, the caller's: an error in DCP's extra writer threads is only printed, and
    # the save then completes without that thread's file (a full disk would go unnoticed). No fsync
    # here: the checkpoint store fsyncs every file while hashing it, overlapping flush and hashing.
    return FileSystemWriter(directory, thread_count=1, sync_files=False)


def save(state: dict[str, Any], directory: Path, group: dist.ProcessGroup | None) -> None:
    try:
        with _single_process_is_intended(group):
            dcp_save(state, storage_writer=_writer(directory), process_group=group, no_dist=group is None)
    except (Exception, CheckpointException) as err:
        raise CheckpointError(
            f"could not write the model/optimizer state to {directory}",
            describe(err),
            "the previous checkpoint is intact and still 'latest'; check free space and permissions",
        ) from None


def async_save(state: dict[str, Any], directory: Path, group: dist.ProcessGroup | None) -> Future[Any]:
    """Copy the state to host memory now and write it in a background thread."""
    with _single_process_is_intended(group):
        result = dcp_async_save(
            state, storage_writer=_writer(directory), process_group=group, no_dist=group is None
        )
    if isinstance(result, Future):
        return result
    return result.upload_completion  # newer torch: AsyncSaveResponse


def load(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    directory: Path,
    group: dist.ProcessGroup | None,
) -> None:
    """Load the model (and the optimizer, when given and saved) in place from ``directory``."""
    reader = SafeFileSystemReader(directory)
    saved = reader.read_metadata().state_dict_metadata
    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    with_optimizer = optimizer is not None and any(key.startswith("optimizer.") for key in saved)
    if with_optimizer:
        assert optimizer is not None
        state["optimizer"] = get_optimizer_state_dict(module, optimizer, options=_FLAT)
    try:
        with _single_process_is_intended(group):
            dcp_load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group,
                 no_dist=group is None)  # fmt: skip
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # DCP wraps per-rank failures in CheckpointException
        for failure in _failures(err):
            if isinstance(failure, CheckpointError):
                raise failure from None
        raise CheckpointError(
            f"cannot load the model/optimizer state in {directory}",
            describe(err),
            "the model or optimizer differs from the one that was saved (names or shapes), "
            "or the files are damaged",
        ) from None
    set_model_state_dict(module, state["model"], options=StateDictOptions(strict=True))
    if with_optimizer:
        assert optimizer is not None
        set_optimizer_state_dict(module, optimizer, state["optimizer"], options=_FLAT)


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with the metadata unpickled by an allow-list of DCP's own classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = Path(self.path) / METADATA
        try:
            with path.open("rb") as handle:
                metadata = _MetadataUnpickler(handle).load()
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing", fix="resume from another checkpoint") from None
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(
                f"cannot read {path}", first_line(err), "resume from another checkpoint"
            ) from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointError(f"{path} does not hold DCP metadata", fix="resume from another checkpoint")
        storage_meta = metadata.storage_meta or dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


def enum_member(cls: Any, name: Any) -> Any:
    """``getattr(EnumClass, "MEMBER")``, the form in which early Python 3.11 releases (3.11.2, Debian
    12's) pickle an enum member (3.10, 3.11.7 and 3.12 pickle ``EnumClass(value)``), for a member of
    an enum and nothing else: the unpicklers map ``builtins.getattr`` to this, the enum class having
    passed their allowlist as any other global."""
    if (
        isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and isinstance(name, str)
        and name in cls.__members__
    ):
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not a member of an enum")


def load_weights_only(
    path: Any, map_location: Any = "cpu", *, allowed_globals: Sequence[Any] = (),
    holds: str = "tensors and plain data", **kwargs: Any,
) -> Any:  # fmt: skip
    """``torch.load`` of a file SpikingSail or DeepSpeed wrote, with ``weights_only=True`` whatever the
    caller asks (plain unpickling would let a checkpoint directory run code) and only
    ``allowed_globals`` beyond torch's own; a missing or unreadable file as ``CheckpointError``."""
    try:
        with torch.serialization.safe_globals([*allowed_globals, (enum_member, "builtins.getattr")]):
            return torch.load(path, map_location=map_location, **{**kwargs, "weights_only": True})
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing", fix="resume from another checkpoint") from None
    except Exception as err:  # torch raises several types for unreadable or unsafe files
        raise CheckpointError(
            f"cannot read {path}",
            first_line(err),
            f"the file is damaged or holds objects other than {holds}; resume from another checkpoint",
        ) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor values (step counts, hyperparameters) read with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as err:
            raise CheckpointError(
                f"the value {fqn!r} in the checkpoint cannot be read safely",
                first_line(err),
                "checkpoints hold tensors and plain data only; resume from another checkpoint",
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("builtins", "getattr"):  # an enum member, as Python 3.11.2 pickles one
            return self._enum_member
        raise _refused(f"{module}.{name}")

    def _enum_member(self, cls: Any, name: Any) -> Any:  # cls passed find_class: one of DCP's classes
        try:
            return enum_member(cls, name)
        except pickle.UnpicklingError:
            raise _refused(f"getattr({cls!r}, {name!r})") from None


def _refused(what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint metadata refers to {what}",
        "DCP metadata holds only DCP's own classes, sizes and dtypes; anything else could run code on load",
        "do not load this checkpoint; it was not written by torch.distributed.checkpoint",
    )


@contextlib.contextmanager
def _single_process_is_intended(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Without a process group DCP warns that it assumes a single process, which is what we ask for."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def describe(err: BaseException) -> str:
    """One line for an error, also for DCP's CheckpointException (a BaseException listing each rank's error)."""
    failures = _failures(err)
    if failures != [err]:
        return "; ".join(f"{type(f).__name__}: {first_line(f)}" for f in failures)
    return first_line(err)


def _failures(err: BaseException) -> list[BaseException]:
    if isinstance(err, CheckpointException):
        return [failure for failure, _trace in err.failures.values()]
    return [err]
