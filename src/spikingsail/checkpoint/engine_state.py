"""What an engine checkpoint holds, and how every rank writes and reads its part.

Replicated state (model, optimizer, scheduler, loss scaler, counters, data positions, config) is
written once by rank 0; each rank writes its own RNG states and, when the save falls inside an
accumulation window, its own partial gradients. Everything is read back with
``torch.load(weights_only=True)``: a checkpoint directory can never run code on load.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from spikingsail.checkpoint.store import CheckpointError, CheckpointStore

if TYPE_CHECKING:
    from spikingsail.engine.engine import Engine

log = logging.getLogger(__name__)
_ALLOWED = (torch.Tensor, int, float, str, bool, bytes, type(None))


def save(engine: Engine, save_dir: str | Path, tag: str | None, client_state: dict[str, Any] | None) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory."""
    client_state = dict(client_state or {})
    _check_client_state(client_state, "client_state")
    tag = tag or f"global_step{engine.global_steps}"
    store = CheckpointStore(save_dir)
    rank = engine.rank
    if rank == 0:
        store.prepare(tag)
    _barrier()
    staging = store.staging(tag)
    (staging / "rng").mkdir(exist_ok=True)
    torch.save(capture_rng(), staging / "rng" / f"rank{rank}.pt")
    if engine.micro_steps % engine.gradient_accumulation_steps():
        (staging / "grads").mkdir(exist_ok=True)
        grads = {name: p.grad for name, p in engine.module.named_parameters() if p.grad is not None}
        torch.save(grads, staging / "grads" / f"rank{rank}.pt")
    if rank == 0:
        torch.save(engine.module.state_dict(), staging / "model.pt")
        torch.save(engine.optimizer.state_dict(), staging / "optimizer.pt")
        torch.save(_engine_state(engine, client_state), staging / "engine.pt")
    _barrier()
    if rank == 0:
        metadata = {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                    "world_size": engine.world_size}  # fmt: skip
        store.commit(tag, metadata)
        store.prune(engine.config.checkpoint.keep_last)
    _barrier()
    return store.root / tag


def load(engine: Engine, load_dir: str | Path, tag: str | None, load_optimizer_states: bool = True
         ) -> tuple[Path, dict[str, Any]]:  # fmt: skip
    """Collective: every rank calls it. Returns (checkpoint directory, client_state)."""
    store = CheckpointStore(load_dir)
    chosen = [store.resolve(tag) if engine.rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0)
    path = store.root / str(chosen[0])
    state = _load(path / "engine.pt")
    saved_world = int(state["world_size"])
    partial_window = bool(state["micro_steps"] % state["gradient_accumulation_steps"])
    if partial_window and saved_world != engine.world_size:
        raise CheckpointError(
            f"{path} was saved inside an accumulation window by {saved_world} process(es); "
            f"this run has {engine.world_size}",
            "the partial gradients of an unfinished window belong to the ranks that computed them",
            "resume with the same number of processes, or from a checkpoint saved on a step boundary",
        )
    engine.module.load_state_dict(_load(path / "model.pt"))
    if load_optimizer_states:
        engine.optimizer.load_state_dict(_load(path / "optimizer.pt"))
    _apply_engine_state(engine, state)
    if saved_world == engine.world_size:
        restore_rng(_load(path / "rng" / f"rank{engine.rank}.pt"))
    else:
        log.warning("resuming %d-process checkpoint on %d processes: data order and batches carry over, "
                    "random number streams start from rank %d's", saved_world, engine.world_size,
                    engine.rank % saved_world)  # fmt: skip
        restore_rng(_load(path / "rng" / f"rank{engine.rank % saved_world}.pt"))
    if partial_window:
        grads = _load(path / "grads" / f"rank{engine.rank}.pt")
        for name, param in engine.module.named_parameters():
            param.grad = grads.get(name)
    _barrier()
    client_state: dict[str, Any] = state["client_state"]
    return path, client_state


def _engine_state(engine: Engine, client_state: dict[str, Any]) -> dict[str, Any]:
    return {
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "world_size": engine.world_size,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
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


def capture_rng() -> dict[str, Any]:
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                  "position": int(position), "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }  # fmt: skip
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy = state["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state((numpy["kind"], keys, numpy["position"], numpy["has_gauss"], numpy["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
