"""What an engine checkpoint holds, and how every rank writes and reads its part.

Model and optimizer state go through torch.distributed.checkpoint into ``state/`` (each replicated
tensor written once, by one of the ranks; sharded state by its owners). The rest of the engine's
state (scheduler, loss scaler, counters, data positions, config, client state) is written once by
rank 0 into ``engine.pt``; each rank writes its own RNG states and, when the save falls inside an
accumulation window, its own partial gradients. Everything is read back with
``torch.load(weights_only=True)`` or DCP's reader with an allow-listed unpickler: a checkpoint
directory can never run code on load.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from spikingsail.checkpoint import dcp_io
from spikingsail.checkpoint.compatibility import check_resumable
from spikingsail.checkpoint.store import CheckpointError, CheckpointStore, seal

if TYPE_CHECKING:
    from spikingsail.backends.base import Backend
    from spikingsail.engine.engine import Engine

log = logging.getLogger(__name__)
_FAILED = "<failed>"
STATE_DIR = "state"
"""Model and optimizer state, written through torch.distributed.checkpoint."""
_ALLOWED = (torch.Tensor, int, float, str, bool, bytes, type(None))


@dataclass(frozen=True)
class SaveHandle:
    """A checkpoint being written: ``wait()`` returns its path once it is complete (committed)."""

    path: Path
    done: Future[None]

    def wait(self) -> Path:
        self.done.result()
        return self.path


def save(
    engine: Engine,
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
    tag = tag or f"global_step{engine.global_steps}"
    backend = engine.backend
    backend.check_can_save(bool(engine.micro_steps % engine.gradient_accumulation_steps()))
    store = CheckpointStore(save_dir)
    rank = engine.rank
    if rank == 0:
        store.prepare(tag)
    _barrier()
    staging = store.staging(tag)
    (staging / "rng").mkdir(exist_ok=True)
    torch.save(capture_rng(engine.device), staging / "rng" / f"rank{rank}.pt")
    if engine.micro_steps % engine.gradient_accumulation_steps():
        (staging / "grads").mkdir(exist_ok=True)
        grads = {name: p.grad for name, p in engine.module.named_parameters() if p.grad is not None}
        torch.save(grads, staging / "grads" / f"rank{rank}.pt")
    if rank == 0:
        torch.save(_engine_state(engine, client_state), staging / "engine.pt")
    metadata = {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                "world_size": engine.world_size}  # fmt: skip
    keep_last = engine.config.checkpoint.keep_last

    def commit() -> None:
        # Each rank fsyncs and hashes what it wrote (in parallel across ranks and threads);
        # rank 0 seals the checkpoint with everyone's manifest entries.
        # A rank that fails still takes part in the gather, so that no rank waits for it forever.
        try:
            entries: dict[str, Any] = seal(staging, _files_written_by(staging, rank, backend))
        except OSError as err:
            entries = {_FAILED: f"rank {rank}: {err}"}
        sealed = _gather_everywhere(entries, group)
        failed = sealed.get(_FAILED)
        if failed:
            raise CheckpointError(
                f"could not seal {staging}", str(failed), "the previous checkpoint is still 'latest'"
            )
        if rank == 0:
            store.commit(tag, metadata, sealed)
            store.prune(keep_last)

    done: Future[None] = Future()
    upload = backend.save_state(engine.module, engine.optimizer, staging / STATE_DIR, group, background)
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
    engine: Engine,
    load_dir: str | Path,
    tag: str | None,
    load_optimizer_states: bool = True,
    *,
    group: dist.ProcessGroup | None,
    module_only: bool = False,
) -> tuple[Path, dict[str, Any]]:
    """Collective: every rank calls it. Returns (checkpoint directory, client_state).

    ``module_only`` reads the weights alone, for a new run that starts from them (no counters,
    optimizer, scheduler, data position or config check)."""
    store = CheckpointStore(load_dir)
    chosen = [store.resolve(tag) if engine.rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0)
    path = store.root / str(chosen[0])
    state = _load(path / "engine.pt")
    _check_format(engine, path, state)
    if module_only:
        engine.backend.load_state(engine.module, None, path / STATE_DIR, group)
        _barrier()
        return path, dict(state["client_state"])
    saved_world = int(state["world_size"])
    partial_window = bool(state["micro_steps"] % state["gradient_accumulation_steps"])
    current = json.loads(json.dumps(dataclasses.asdict(engine.config), default=str))
    saved_config = json.loads(state["config"]) if "config" in state else {}
    check_resumable(path, saved_config, current, partial_window=partial_window,
                    with_optimizer=load_optimizer_states)  # fmt: skip
    engine.backend.check_can_load(path, saved_world)
    engine.backend.load_state(
        engine.module, engine.optimizer if load_optimizer_states else None, path / STATE_DIR, group
    )
    if load_optimizer_states and len(state["optimizer_groups"]) == len(engine.optimizer.param_groups):
        for group_now, saved in zip(engine.optimizer.param_groups, state["optimizer_groups"], strict=True):
            group_now.update(saved)
    _apply_engine_state(engine, state)
    if not partial_window:
        # on a step boundary the split of train_batch_size may have changed: count the micro-steps
        # in this run's accumulation, so that the next window is whole
        engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    if saved_world == engine.world_size:
        restore_rng(_load(path / "rng" / f"rank{engine.rank}.pt"), engine.device)
    else:
        log.warning("resuming %d-process checkpoint on %d processes: data order and batches carry over, "
                    "random number streams start from rank %d's", saved_world, engine.world_size,
                    engine.rank % saved_world)  # fmt: skip
        restore_rng(_load(path / "rng" / f"rank{engine.rank % saved_world}.pt"), engine.device)
    if partial_window:
        restore_grads(engine.module, _load(path / "grads" / f"rank{engine.rank}.pt"))
    _barrier()
    client_state: dict[str, Any] = state["client_state"]
    return path, client_state


def _check_format(engine: Engine, path: Path, state: dict[str, Any]) -> None:
    saved_format = str(state.get("state_format", "dcp"))
    if saved_format != engine.backend.checkpoint_format:
        raise CheckpointError(
            f"{path} holds {saved_format} state; backend {engine.backend.name} reads "
            f"{engine.backend.checkpoint_format} checkpoints",
            "DeepSpeed's ZeRO checkpoints keep flat optimizer partitions that other backends cannot map "
            "to parameters (and the other way round)",
            f"resume with the backend that wrote it ({state.get('backend', saved_format)}), or start a "
            "new run; DDP, FSDP and Horovod checkpoints load into each other",
        )


def _files_written_by(staging: Path, rank: int, backend: Backend) -> list[Path]:
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


def _engine_state(engine: Engine, client_state: dict[str, Any]) -> dict[str, Any]:
    return {
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "world_size": engine.world_size,
        "backend": engine.backend.name,
        "state_format": engine.backend.checkpoint_format,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        # also here: an optimizer without per-parameter state (plain SGD) has none in state/
        "optimizer_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups
        ],
        "precision": engine.precision.state_dict(),
        "loaders": [loader.state_dict() for loader in engine.loaders],
        "config": json.dumps(dataclasses.asdict(engine.config), default=str),
        "client_state": client_state,
    }


def _apply_engine_state(engine: Engine, state: dict[str, Any]) -> None:
    engine.global_steps = int(state["global_steps"])
    engine.micro_steps = int(state["micro_steps"])
    engine.global_samples = int(state["global_samples"])
    engine.skipped_steps = int(state["skipped_steps"])
    if engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.precision.load_state_dict(state["precision"])
    engine.restore_loaders(list(state["loaders"]))


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


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing", fix="resume from another checkpoint") from None
    except Exception as err:  # torch raises several types for unreadable or unsafe files
        raise CheckpointError(
            f"cannot read {path}",
            str(err).splitlines()[0],
            "the file is damaged or holds objects other than tensors and plain data; "
            "resume from another checkpoint",
        ) from None


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
