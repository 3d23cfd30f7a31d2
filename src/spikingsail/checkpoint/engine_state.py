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

import json
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from spikingsail.checkpoint.compatibility import check_resumable
from spikingsail.checkpoint.faults import FULL_BYTES, Failure, estimate_bytes, save_error
from spikingsail.checkpoint.lock import fence
from spikingsail.checkpoint.rank_state import capture_rng, restore_buffers, restore_grads, restore_rng
from spikingsail.checkpoint.store import CheckpointStore, seal
from spikingsail.environments import RankInfo
from spikingsail.errors import CheckpointError
from spikingsail.mounts import free_bytes

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

# torch.distributed.checkpoint (and with it DTensor and sympy: a second of CPU in each process) is
# imported where a checkpoint is written or read, not when a training process starts.

log = logging.getLogger(__name__)
_T = TypeVar("_T")
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

    @property
    def rank_buffers(self) -> bool:
        """Whether each rank's buffers are its own between the points that make them rank 0's: each
        rank's are then saved beside the state (``rank_buffers/rankR.pt``)."""

    def check_can_save(self, mid_window: bool) -> None: ...

    def check_can_load(self, directory: Path, saved_world_size: int) -> None: ...

    def save_state(
        self, directory: Path, group: dist.ProcessGroup | None, background: bool
    ) -> Future[Any] | None:
        """Write the state of the model and optimizer the backend set up into ``directory`` (collective)."""

    def load_state(self, directory: Path, group: dist.ProcessGroup | None, *, with_optimizer: bool) -> None:
        """Read it back (collective); without the optimizer: the weights only."""

    def own_state_files(self, directory: Path, rank: int) -> list[Path]: ...

    def consolidated_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state on every rank (shards and partitions gathered), for ``save_model``."""
        ...


@dataclass(frozen=True, kw_only=True)
class TrainingState:
    """Everything a checkpoint saves of a run, and restores into it."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    """None on load: the weights without the optimizer's state."""
    backend: StateBackend
    config: dict[str, Any]
    """The run's config as a checkpoint records it (``compatibility.as_saved``), which a resume compares."""
    keep_last: int
    """How many of the newest good checkpoints a save keeps (``checkpoint.keep_last``; 0: all)."""
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
    writer_group: dist.ProcessGroup | None = None,
    background: bool = False,
    create: bool = True,
) -> SaveHandle:
    """Collective: every rank calls it.

    In the background, the model and optimizer state is copied to host memory before this
    returns, then written (and rank 0 commits the checkpoint) by a thread.

    The ranks agree after each phase whether every one of them succeeded: a failure on any rank
    (a full disk, a read-only or vanished directory) removes the unfinished checkpoint and raises
    the same ``CheckpointError`` on every rank — at once, or from ``SaveHandle.wait`` in the
    background — with ``latest`` and the earlier checkpoints untouched. ``create`` False: the
    directory must exist (it did; one that vanished is not made again). ``writer_group``: the
    backend's group for writing (default ``group``), which a background writer thread uses while
    the ranks agree in ``group``.
    """
    client_state = dict(client_state or {})
    _check_client_state(client_state, "client_state")
    if training.optimizer is None:
        raise ValueError("a checkpoint saves the optimizer's state: TrainingState.optimizer is None")
    entries = merged_state_dict(training.states)
    tag = tag or f"global_step{entries['global_steps']}"
    mid_window = bool(entries["micro_steps"] % entries["gradient_accumulation_steps"])
    training.backend.check_can_save(mid_window)
    saving = _Saving(CheckpointStore(save_dir), tag, training, group)
    staging = saving.store.staging(tag)
    metadata = {"global_steps": entries["global_steps"], "micro_steps": entries["micro_steps"],
                "world_size": training.rank_info.world_size}  # fmt: skip
    done: Future[None] = Future()
    try:
        saving.agree(lambda: saving.prepare(create))
        saving.agree(
            lambda: _write_own_files(training, staging, entries, client_state, mid_window=mid_window)
        )
        upload = saving.agree(
            lambda: training.backend.save_state(staging / STATE_DIR, writer_group or group, background)
        )
        if upload is None:
            saving.commit(metadata)
    except SaveFailedError as failed:
        raise saving.give_up(failed) from None
    if upload is None:
        done.set_result(None)
    else:
        upload.add_done_callback(lambda upload: saving.finish(upload, metadata, done))
    return SaveHandle(saving.store.root / tag, done)


class SaveFailedError(Exception):
    """A save failed on some rank (raised on every rank; ``_Saving.give_up`` words it)."""

    def __init__(self, failures: list[Failure]) -> None:
        super().__init__(failures)
        self.failures = failures


@dataclass(frozen=True)
class _Saving:
    """One save's agreement between the ranks, and its cleanup when it fails."""

    store: CheckpointStore
    tag: str
    training: TrainingState
    group: dist.ProcessGroup | None

    def agree(self, action: Callable[[], _T]) -> _T:
        """``action()`` on every rank; if it failed on any, ``SaveFailedError`` (with every rank's failure)
        on every rank."""
        from torch.distributed.checkpoint.api import CheckpointException

        rank = self.training.rank_info.rank
        result: _T | None = None
        failure: Failure | None = None
        try:
            result = action()
        except (Exception, CheckpointException) as err:
            log.debug("checkpoint %s: rank %d failed", self.tag, rank, exc_info=True)
            failure = Failure.of(err, rank)
        failures = [f for f in _gather_list(failure, self.group) if f is not None]
        if failures:
            raise SaveFailedError(failures)
        return result  # type: ignore[return-value]  # None only where action returns None

    def prepare(self, create: bool) -> None:
        if self.training.rank_info.rank == 0:
            self.store.prepare(self.tag, create=create)
            # before the backend writes: DeepSpeed's rank 0 would make it alone, between barriers
            (self.store.staging(self.tag) / STATE_DIR).mkdir()

    def commit(self, metadata: dict[str, Any]) -> None:
        """Each rank fsyncs and hashes what it wrote (in parallel across ranks and threads); rank 0
        seals the checkpoint with everyone's manifest entries, puts it in place and prunes."""
        rank, staging = self.training.rank_info.rank, self.store.staging(self.tag)
        own = self.agree(lambda: seal(staging, _files_written_by(staging, rank, self.training.backend)))
        sealed = _gather_everywhere(own, self.group)

        def put_in_place() -> None:
            if rank == 0:
                fence(self.store.root)  # a job whose directory lock was taken while it wrote commits nothing
                self.store.commit(self.tag, metadata, sealed)
                self.store.prune(self.training.keep_last)

        self.agree(put_in_place)

    def finish(self, upload: Future[Any], metadata: dict[str, Any], done: Future[None]) -> None:
        """The background half of a save (in the writer's thread): agree that every rank's upload
        succeeded, commit, and hand the outcome to whoever waits for the save."""
        try:
            self.agree(upload.result)
            self.commit(metadata)
        except SaveFailedError as failed:
            try:
                done.set_exception(self.give_up(failed))
            except BaseException as err:  # the ranks could not even agree on the message
                done.set_exception(err)
        except BaseException as err:
            done.set_exception(err)
        else:
            done.set_result(None)

    def give_up(self, failed: SaveFailedError) -> CheckpointError:
        """Rank 0 removes the unfinished checkpoint and words the failure; every rank gets the error."""
        parts: list[Any] = [None]
        if self.training.rank_info.rank == 0:
            try:
                err = self._cleaned_up(failed)
            except Exception as unexpected:  # the other ranks wait for the message: never leave them
                log.debug("wording the failed save", exc_info=True)
                err = CheckpointError(f"checkpoint {self.tag} could not be saved in {self.store.root}",
                                      "; ".join(f.text for f in failed.failures) + f" (then: {unexpected})")  # fmt: skip
            parts = [(err.what, err.why, err.fix)]
        if self.group is not None:
            dist.broadcast_object_list(parts, src=0, group=self.group)
        return CheckpointError(*parts[0])

    def _cleaned_up(self, failed: SaveFailedError) -> CheckpointError:
        root, staging = self.store.root, self.store.staging(self.tag)
        # before the cleanup frees what the save took: was there room for the whole checkpoint?
        free_then, staged = free_bytes(root) or 0, _bytes_under(staging)
        self.store.abandon(self.tag)
        last_good = self.store.latest() if root.is_dir() else None
        assert self.training.optimizer is not None  # save() refuses a state without one
        needed = (self.store.size(last_good) if last_good else None) or estimate_bytes(
            self.training.module, self.training.optimizer
        )
        full = free_then < FULL_BYTES or free_then + staged < needed
        return save_error(failed.failures, root, self.tag, full=full, needed=needed, last_good=last_good)


def _bytes_under(directory: Path) -> int:
    try:
        return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    except OSError:
        return 0


def load(
    training: TrainingState, load_dir: str | Path, tag: str | None, *, group: dist.ProcessGroup | None
) -> tuple[Path, dict[str, Any]]:
    """Collective: every rank calls it. Returns (checkpoint directory, client_state).

    A resume continues the saved run: the config must allow it (``check_resumable``), then the
    model and optimizer state, every ``Stateful``, the random streams and (inside an accumulation
    window) the partial gradients are restored."""
    from spikingsail.checkpoint import dcp_io

    path, saved = _choose(training, load_dir, tag)
    saved_world = int(saved["world_size"])
    rank, world_size = training.rank_info.rank, training.rank_info.world_size
    partial_window = bool(saved["micro_steps"] % saved["gradient_accumulation_steps"])
    current = training.config
    saved_config = json.loads(saved["config"]) if "config" in saved else {}
    check_resumable(path, saved_config, current, partial_window=partial_window,
                    with_optimizer=training.optimizer is not None)  # fmt: skip
    training.backend.check_can_load(path, saved_world)
    training.backend.load_state(path / STATE_DIR, group, with_optimizer=training.optimizer is not None)
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
    own_buffers = path / "rank_buffers" / f"rank{rank}.pt"
    if saved_world == world_size and own_buffers.is_file():  # else rank 0's, from the state
        restore_buffers(training.module, dcp_io.load_weights_only(own_buffers))
    _barrier()
    client_state: dict[str, Any] = saved["client_state"]
    return path, client_state


def load_weights(
    training: TrainingState, load_dir: str | Path, tag: str | None, *, group: dist.ProcessGroup | None
) -> tuple[Path, dict[str, Any]]:
    """Collective: the weights alone, for a new run that starts from them (no counters, optimizer,
    scheduler, data position or config check). Returns (checkpoint directory, client_state)."""
    path, saved = _choose(training, load_dir, tag)
    training.backend.load_state(path / STATE_DIR, group, with_optimizer=False)
    _barrier()
    return path, dict(saved["client_state"])


def _choose(training: TrainingState, load_dir: str | Path, tag: str | None) -> tuple[Path, dict[str, Any]]:
    """Rank 0's choice of checkpoint (``tag``, or the latest good one) and its ``engine.pt``."""
    store = CheckpointStore(load_dir)
    chosen: list[Any] = [None]
    read: dict[Path, dict[str, Any]] = {}  # rank 0 reads the chosen engine.pt once

    def check(path: Path) -> None:
        read[path] = _read_engine_file(path)

    if training.rank_info.rank == 0:
        try:  # without a tag, the newest checkpoint whose engine.pt reads too
            chosen = [store.resolve(tag, check=check)]
        except CheckpointError as err:  # every rank raises it, none waits for rank 0's choice
            chosen = [(err.what, err.why, err.fix)]
    if dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0)
    if isinstance(chosen[0], tuple):
        raise CheckpointError(*chosen[0])
    path = store.root / str(chosen[0])
    saved = read[path] if path in read else _read_engine_file(path)
    _check_format(training.backend, path, saved)
    return path, saved


def _read_engine_file(path: Path) -> dict[str, Any]:
    """A checkpoint's ``engine.pt``, which must be a dict (its hash matched the manifest: one that is
    not was written so, not damaged on disk)."""
    from spikingsail.checkpoint import dcp_io

    saved = dcp_io.load_weights_only(path / "engine.pt")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path / 'engine.pt'} is not a SpikingSail engine file",
                              f"it holds a {type(saved).__name__}, not a dict",
                              "load another tag (engine.load_checkpoint(DIR, TAG)), or start a new run")  # fmt: skip
    return saved


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
    """This rank's RNG states, partial gradients and own buffers; on rank 0, ``engine.pt``."""
    rank = training.rank_info.rank
    (staging / "rng").mkdir(exist_ok=True)
    torch.save(capture_rng(training.device), staging / "rng" / f"rank{rank}.pt")
    if mid_window:
        (staging / "grads").mkdir(exist_ok=True)
        grads = {name: p.grad for name, p in training.module.named_parameters() if p.grad is not None}
        torch.save(grads, staging / "grads" / f"rank{rank}.pt")
    if training.backend.rank_buffers:
        (staging / "rank_buffers").mkdir(exist_ok=True)
        own = {name: buffer.detach().cpu().clone() for name, buffer in training.module.named_buffers()}
        torch.save(own, staging / "rank_buffers" / f"rank{rank}.pt")
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
        "config": json.dumps(training.config),
        "client_state": client_state,
    }


def _files_written_by(staging: Path, rank: int, backend: StateBackend) -> list[Path]:
    from spikingsail.checkpoint import dcp_io

    own = [staging / "rng" / f"rank{rank}.pt", staging / "grads" / f"rank{rank}.pt",
           staging / "rank_buffers" / f"rank{rank}.pt", *backend.own_state_files(staging / STATE_DIR, rank)]  # fmt: skip
    if rank == 0:
        own += [staging / "engine.pt", staging / STATE_DIR / dcp_io.METADATA]
    return [path for path in own if path.is_file()]


def _gather_everywhere(entries: dict[str, Any], group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Every rank's entries, merged, on every rank."""
    merged: dict[str, Any] = {}
    for part in _gather_list(entries, group):
        merged.update(part)
    return merged


def _gather_list(value: _T, group: dist.ProcessGroup | None) -> list[_T]:
    if group is None:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


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
