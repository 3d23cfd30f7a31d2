"""What a checkpoint holds, and how every rank writes and reads its part.

The checkpoint package does not know the engine. A save or load is handed a ``TrainingState``:
the module and optimizer, the backend (which writes their state in its own format), the config,
and a dict of ``Stateful`` objects (torch.distributed.checkpoint's protocol: the step counters,
loss scaler, scheduler, optimizer hyper-parameters, data positions).

Model and optimizer state go through the backend into ``state/`` (DCP: each replicated tensor
written once, by one of the ranks; sharded state by its owners). The union of the ``Stateful``
objects' state dicts, with the config and client state, is written once by rank 0 into
``engine.pt``; each rank writes its own RNG states and, when the save falls inside an accumulation
window, its own partial gradients. A resume compares the saved config with the current one
(``compatibility.py``) before anything is restored. Everything is read back with
``torch.load(weights_only=True)`` or DCP's reader with an allow-listed unpickler: a checkpoint
directory can never run code on load.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from spikingsail.checkpoint import dcp_io
from spikingsail.checkpoint.compatibility import check_resumable
from spikingsail.checkpoint.store import CheckpointStore, seal
from spikingsail.config.schema import SailConfig
from spikingsail.environments import RankInfo
from spikingsail.errors import CheckpointError

log = logging.getLogger(__name__)
_FAILED = "<failed>"
STATE_DIR = "state"
"""Model and optimizer state, written through torch.distributed.checkpoint."""
_ALLOWED = (torch.Tensor, int, float, str, bool, bytes, type(None))


class StateBackend(Protocol):
    """What a checkpoint asks of a parallelism backend (``spikingsail.backends.base.Backend``)."""

    @property
    def name(self) -> str: ...

    @property
    def checkpoint_format(self) -> str:
        """How model and optimizer state is written; checkpoints load only into the same format."""

    def check_can_save(self, mid_window: bool) -> None: ...

    def check_can_load(self, directory: Path, saved_world_size: int) -> None: ...

    def save_state(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        directory: Path,
        group: dist.ProcessGroup | None,
        background: bool,
    ) -> Future[Any] | None: ...

    def load_state(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        directory: Path,
        group: dist.ProcessGroup | None,
    ) -> None: ...

    def own_state_files(self, directory: Path, rank: int) -> list[Path]: ...


@dataclass(frozen=True, kw_only=True)
class TrainingState:
    """Everything a checkpoint saves of a run, and restores into it."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    """None on load: the weights without the optimizer's state."""
    backend: StateBackend
    config: SailConfig
    rank_info: RankInfo
    device: torch.device
    states: Mapping[str, Stateful]
    """``engine.pt`` holds the union of their state dicts (so their keys must differ), among them the
    step counters ``global_steps``, ``micro_steps`` and ``gradient_accumulation_steps``; on load each
    is given the whole dict, in this mapping's order."""


def merged_state_dict(states: Mapping[str, Stateful]) -> dict[str, Any]:
    """The union of the state dicts of ``states``, which must not share keys."""
    merged: dict[str, Any] = {}
    for name, stateful in states.items():
        entries = stateful.state_dict()
        clash = merged.keys() & entries.keys()
        if clash:
            raise ValueError(f"state {name!r} repeats the checkpoint entries {sorted(clash)}")
        merged.update(entries)
    return merged


@dataclass(frozen=True)
class SaveHandle:
    """A checkpoint being written: ``wait()`` returns its path once it is complete (committed)."""

    path: Path
    done: Future[None]

    def wait(self) -> Path:
        self.done.result()
        return self.path


def save(
    training: TrainingState,
    save_dir: str | Path,
    tag: str | None,
    client_state: dict[str, Any] | None,
    *,
    group: dist.ProcessGroup | None,
    background: bool = False,
) -> SaveHandle:
    """Collective: every rank calls it.

    In the background, the model and optimizer state is copied to host memory before this
    returns, then written (and rank 0 commits the checkpoint) by a thread.
    """
    client_state = dict(client_state or {})
    _check_client_state(client_state, "client_state")
    if training.optimizer is None:
        raise ValueError("a checkpoint saves the optimizer's state: TrainingState.optimizer is None")
    entries = merged_state_dict(training.states)
    tag = tag or f"global_step{entries['global_steps']}"
    backend = training.backend
    mid_window = bool(entries["micro_steps"] % entries["gradient_accumulation_steps"])
    backend.check_can_save(mid_window)
    store = CheckpointStore(save_dir)
    rank, world_size = training.rank_info.rank, training.rank_info.world_size
    if rank == 0:
        store.prepare(tag)
    _barrier()
    staging = store.staging(tag)
    _write_own_files(training, staging, entries, client_state, mid_window=mid_window)
    metadata = {"global_steps": entries["global_steps"], "micro_steps": entries["micro_steps"],
                "world_size": world_size}  # fmt: skip
    keep_last = training.config.checkpoint.keep_last

    def commit() -> None:
        # Each rank fsyncs and hashes what it wrote (in parallel across ranks and threads);
        # rank 0 seals the checkpoint with everyone's manifest entries.
        # A rank that fails still takes part in the gather, so that no rank waits for it forever.
        try:
            own: dict[str, Any] = seal(staging, _files_written_by(staging, rank, backend))
        except OSError as err:
            own = {_FAILED: f"rank {rank}: {err}"}
        sealed = _gather_everywhere(own, group)
        failed = sealed.get(_FAILED)
        if failed:
            raise CheckpointError(
                f"could not seal {staging}", str(failed), "the previous checkpoint is still 'latest'"
            )
        if rank == 0:
            store.commit(tag, metadata, sealed)
            store.prune(keep_last)

    done: Future[None] = Future()
    upload = backend.save_state(training.module, training.optimizer, staging / STATE_DIR, group, background)
    if upload is None:
        commit()
        _barrier()
        done.set_result(None)
        return SaveHandle(store.root / tag, done)

    def finish(upload: Future[Any]) -> None:
        try:
            upload.result()
            commit()
        except BaseException as err:  # handed to whoever waits for the save
            done.set_exception(err)
        else:
            done.set_result(None)

    upload.add_done_callback(finish)
    return SaveHandle(store.root / tag, done)


def load(
    training: TrainingState, load_dir: str | Path, tag: str | None, *, group: dist.ProcessGroup | None
) -> tuple[Path, dict[str, Any]]:
    """Collective: every rank calls it. Returns (checkpoint directory, client_state).

    A resume continues the saved run: the config must allow it (``check_resumable``), then the
    model and optimizer state, every ``Stateful``, the random streams and (inside an accumulation
    window) the partial gradients are restored."""
    path, saved = _choose(training, load_dir, tag)
    saved_world = int(saved["world_size"])
    rank, world_size = training.rank_info.rank, training.rank_info.world_size
    partial_window = bool(saved["micro_steps"] % saved["gradient_accumulation_steps"])
    current = json.loads(json.dumps(dataclasses.asdict(training.config), default=str))
    saved_config = json.loads(saved["config"]) if "config" in saved else {}
    check_resumable(path, saved_config, current, partial_window=partial_window,
                    with_optimizer=training.optimizer is not None)  # fmt: skip
    training.backend.check_can_load(path, saved_world)
    training.backend.load_state(training.module, training.optimizer, path / STATE_DIR, group)
    for stateful in training.states.values():
        stateful.load_state_dict(saved)
    if saved_world == world_size:
        restore_rng(dcp_io.load_weights_only(path / "rng" / f"rank{rank}.pt"), training.device)
    else:
        log.warning("resuming %d-process checkpoint on %d processes: data order and batches carry over, "
                    "random number streams start from rank %d's", saved_world, world_size,
                    rank % saved_world)  # fmt: skip
        restore_rng(dcp_io.load_weights_only(path / "rng" / f"rank{rank % saved_world}.pt"), training.device)
    if partial_window:
        restore_grads(training.module, dcp_io.load_weights_only(path / "grads" / f"rank{rank}.pt"))
    _barrier()
    client_state: dict[str, Any] = saved["client_state"]
    return path, client_state


def load_weights(
    training: TrainingState, load_dir: str | Path, tag: str | None, *, group: dist.ProcessGroup | None
) -> tuple[Path, dict[str, Any]]:
    """Collective: the weights alone, for a new run that starts from them (no counters, optimizer,
    scheduler, data position or config check). Returns (checkpoint directory, client_state)."""
    path, saved = _choose(training, load_dir, tag)
    training.backend.load_state(training.module, None, path / STATE_DIR, group)
    _barrier()
    return path, dict(saved["client_state"])


def _choose(training: TrainingState, load_dir: str | Path, tag: str | None) -> tuple[Path, dict[str, Any]]:
    """Rank 0's choice of checkpoint (``tag``, or the latest good one) and its ``engine.pt``."""
    store = CheckpointStore(load_dir)
    chosen = [store.resolve(tag) if training.rank_info.rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0)
    path = store.root / str(chosen[0])
    saved = dcp_io.load_weights_only(path / "engine.pt")
    _check_format(training.backend, path, saved)
    return path, saved


def _check_format(backend: StateBackend, path: Path, state: dict[str, Any]) -> None:
    saved_format = str(state.get("state_format", "dcp"))
    if saved_format != backend.checkpoint_format:
        raise CheckpointError(
            f"{path} holds {saved_format} state; backend {backend.name} reads "
            f"{backend.checkpoint_format} checkpoints",
            "DeepSpeed's ZeRO checkpoints keep flat optimizer partitions that other backends cannot map "
            "to parameters (and the other way round)",
            f"resume with the backend that wrote it ({state.get('backend', saved_format)}), or start a "
            "new run; DDP, FSDP and Horovod checkpoints load into each other",
        )


def _write_own_files(
    training: TrainingState,
    staging: Path,
    entries: dict[str, Any],
    client_state: dict[str, Any],
    *,
    mid_window: bool,
) -> None:
    """This rank's RNG states and partial gradients; on rank 0, ``engine.pt``."""
    rank = training.rank_info.rank
    (staging / "rng").mkdir(exist_ok=True)
    torch.save(capture_rng(training.device), staging / "rng" / f"rank{rank}.pt")
    if mid_window:
        (staging / "grads").mkdir(exist_ok=True)
        grads = {name: p.grad for name, p in training.module.named_parameters() if p.grad is not None}
        torch.save(grads, staging / "grads" / f"rank{rank}.pt")
    if rank == 0:
        torch.save(_engine_file(training, entries, client_state), staging / "engine.pt")


def _engine_file(
    training: TrainingState, entries: dict[str, Any], client_state: dict[str, Any]
) -> dict[str, Any]:
    return {
        **entries,
        "world_size": training.rank_info.world_size,
        "backend": training.backend.name,
        "state_format": training.backend.checkpoint_format,
        "config": json.dumps(dataclasses.asdict(training.config), default=str),
        "client_state": client_state,
    }


def _files_written_by(staging: Path, rank: int, backend: StateBackend) -> list[Path]:
    own = [staging / "rng" / f"rank{rank}.pt", staging / "grads" / f"rank{rank}.pt",
           *backend.own_state_files(staging / STATE_DIR, rank)]  # fmt: skip
    if rank == 0:
        own += [staging / "engine.pt", staging / STATE_DIR / dcp_io.METADATA]
    return [path for path in own if path.is_file()]


def _gather_everywhere(entries: dict[str, Any], group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Every rank's entries, on every rank (so that a failure on one is known to all)."""
    if group is None:
        return entries
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, entries, group=group)
    merged: dict[str, Any] = {}
    for part in gathered:
        merged.update(part)
    return merged


def restore_grads(module: torch.nn.Module, grads: dict[str, torch.Tensor | None]) -> None:
    """Put the gradients of a window in progress back, each on its parameter's device (they were
    read onto the CPU)."""
    for name, param in module.named_parameters():
        grad = grads.get(name)
        param.grad = None if grad is None else grad.to(param.device, non_blocking=True)


def capture_rng(device: torch.device) -> dict[str, Any]:
    """The random streams this rank draws from: Python, NumPy, torch's CPU generator, and the
    generator of the rank's own GPU (not every visible GPU's: another job shape may see fewer, or
    give this rank another index)."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                  "position": int(position), "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }  # fmt: skip
    if device.type == "cuda":
        state["cuda_device"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Restore what ``capture_rng`` saved; the saved GPU stream goes to this rank's own device,
    whatever its index now."""
    random.setstate(state["python"])
    numpy = state["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state((numpy["kind"], keys, numpy["position"], numpy["has_gauss"], numpy["cached"]))
    torch.set_rng_state(state["torch"])
    if device.type != "cuda":
        return
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"], device)
    elif "cuda" in state:  # written by earlier versions: every visible GPU's stream, by index
        saved = state["cuda"]
        own = saved[device.index or 0] if (device.index or 0) < len(saved) else None
        if own is None:
            log.warning("the checkpoint has no random state for GPU %s; its stream starts afresh", device)
        else:
            torch.cuda.set_rng_state(own, device)


def _check_client_state(value: Any, where: str) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise CheckpointError(f"{where} has a key of type {type(key).__name__}", fix="use str keys")
            _check_client_state(item, f"{where}[{key!r}]")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_client_state(item, f"{where}[{index}]")
    elif not isinstance(value, _ALLOWED):
        raise CheckpointError(
            f"{where} is a {type(value).__name__}",
            "checkpoints are loaded with weights_only=True, which reads tensors and plain data only",
            "store tensors, numbers, strings, bools, None, and lists/tuples/dicts of them",
        )


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
