"""The checkpoint policy of a training job: when to save, saving in the background, the checkpoint
directory's job lock and room check, the process groups the ranks coordinate saves in, and the save
before a requeue.

The engine keeps DeepSpeed's names (``save_checkpoint``, ``load_checkpoint``) and delegates to a
``Checkpointer``; the engine's step calls ``after_step()`` at every optimizer-step boundary when a
periodic save, a background save or the preemption watch needs it. The checkpointer does not know
the engine: it is handed the state to save (``TrainingState``), the step counters, the heartbeat and
where to report a failed save.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from spikingsail.checkpoint import engine_state, faults
from spikingsail.checkpoint.engine_state import TrainingState
from spikingsail.checkpoint.lock import JobLock, fence
from spikingsail.checkpoint.preemption import PREEMPTED_EXIT_CODE, PreemptionWatch
from spikingsail.checkpoint.store import CheckpointStore
from spikingsail.config.schema import CheckpointConfig
from spikingsail.environments import RankInfo
from spikingsail.errors import CheckpointError, ConfigError, SailError
from spikingsail.monitor.hangwatch import CHECKPOINT

log = logging.getLogger(__name__)


class Steps(Protocol):
    """The engine's step counters (``engine.state.StepCounters``)."""

    accumulation: int
    micro_steps: int
    global_steps: int


class Beat(Protocol):
    """This rank's heartbeat for the hang watch (``monitor.heartbeat``)."""

    def enter(self, phase: int, *, collective: bool = False) -> None: ...

    def leave(self, step: int, micro_step: int) -> None: ...


def on_rank_zero(action: Callable[[], Any], rank_info: RankInfo) -> Any:
    """Run ``action`` on rank 0 and hand every rank its result, or raise its ``SailError`` on every
    rank (so that no rank waits for one that stopped)."""
    outcome: list[Any] = [None]
    if rank_info.is_rank_zero:
        try:
            outcome = [("ok", action())]
        except SailError as err:
            outcome = [("error", err)]
    if dist.is_initialized() and rank_info.world_size > 1:
        dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "error":
        raise value
    return value


def refuse_inside_window(steps: Steps, what: str) -> None:
    """Replica groups save and resume on step boundaries only."""
    if steps.micro_steps % steps.accumulation:
        raise ConfigError(
            f"cannot {what} inside a gradient accumulation window with replica groups (micro-step "
            f"{steps.micro_steps % steps.accumulation} of {steps.accumulation} of step {steps.global_steps + 1})",
            "each replica group holds only its own share of the window's gradient, and a resume "
            "continues from one group's checkpoint",
            "save on a step boundary (is_gradient_accumulation_boundary(); the periodic saves do)",
        )


class Checkpointer:
    """Saves and loads for one engine; ``start()`` makes one and takes the directory's job lock."""

    def __init__(
        self,
        policy: CheckpointConfig,
        *,
        rank_info: RankInfo,
        device: torch.device,
        state: Callable[[bool], TrainingState],
        steps: Steps,
        beat: Beat,
        report: Callable[[str, str, int], None],
        replica_group: int | None = None,
        close_job: Callable[[], None] = lambda: None,
    ) -> None:
        """``state(with_optimizer)``: what a save writes and a load restores; ``report(kind, message,
        step)``: where a failed periodic save is recorded besides the log (the metrics file);
        ``replica_group``: under ``--ft-replicas``, the group whose own directory this one saves in;
        ``close_job``: what the requeue save runs before the process exits."""
        self.policy = policy
        self.rank_info = rank_info
        self.device = device
        self._state, self._steps, self._beat, self._report = state, steps, beat, report
        self.replica_group = replica_group
        self._close_job = close_job
        self._last_save = time.monotonic()
        self._last_saved: tuple[str, int] | None = None  # (directory, micro_steps) of the last save
        self._pending: tuple[engine_state.SaveHandle, bool] | None = None
        self.saved_in_background = False
        """A background save was made: every step then asks whether one has finished on every rank."""
        self._groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
        self._known_roots: set[str] = set()  # checkpoint directories that existed: not made again
        self._lock: JobLock | None = None
        self.preemption = PreemptionWatch(policy.path is not None and policy.save_on_preemption)
        self.periodic = bool(policy.path and (policy.interval_steps or policy.interval_seconds))

    @classmethod
    def start(cls, policy: CheckpointConfig, **kwargs: Any) -> Checkpointer:
        """A checkpointer that holds the job lock of ``policy.path`` (when set), after checking on every
        rank that the directory is writable and has room; on a refusal nothing of it stays up."""
        checkpointer = cls(policy, **kwargs)
        if policy.path is not None:
            try:
                checkpointer._check_directory(Path(policy.path))
                checkpointer._lock = checkpointer._agree_on_lock(
                    JobLock(policy.path) if checkpointer.rank_info.is_rank_zero else None
                )
            except BaseException:
                checkpointer.close()
                raise
        return checkpointer

    @property
    def background_save(self) -> engine_state.SaveHandle | None:
        """The background save being written, until a step or a wait settles it."""
        return self._pending[0] if self._pending is not None else None

    @property
    def wants_steps(self) -> bool:
        """Whether ``after_step`` has anything to do at a step boundary."""
        return self.periodic or self.preemption.armed or self.saved_in_background

    def step_end(self, boundary: bool) -> None:
        """The engine's step hook (``engine/hooks.py``): ``after_step`` at each optimizer-step boundary."""
        if boundary:
            self.after_step()

    def after_step(self) -> None:
        """At an optimizer-step boundary, after the counters moved on (a checkpoint records the step
        as finished): settle a finished background save, save when one is due, and save and exit
        when a rank was asked to stop."""
        self._poll_background_save()
        if self.periodic:
            self._maybe_save()
        if self.preemption.agreed(self.device):
            self._save_and_exit_for_requeue()

    # -- saving ----------------------------------------------------------------------------------

    def save(
        self,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        *,
        async_save: bool | None = None,
        stops: bool = True,
    ) -> str:
        """``engine.save_checkpoint``; ``stops``: whether a failure of this save in the background ends
        the job (raised where it surfaces) or is only reported (a periodic save under on_error "continue")."""
        self.wait()
        if self.replica_group is not None:
            from spikingsail.checkpoint.replica_dirs import own_group_checkpoints

            refuse_inside_window(self._steps, "save")
            save_dir = own_group_checkpoints(save_dir, self.replica_group)
        root = str(Path(save_dir))
        if tag is None and self._last_saved == (root, self._steps.micro_steps):
            # the periodic save wrote this step's state here already (engine.save_checkpoint after it)
            path = str(Path(root) / f"global_step{self._steps.global_steps}")
            if not client_state:
                log.info(
                    "checkpoint %s: saved at this step already (checkpoint.interval_*); not saved again", path
                )
                return path
            log.info("checkpoint %s: saved at this step already; saved again, now with client_state", path)
        on_rank_zero(lambda: fence(save_dir), self.rank_info)  # a job whose lock was taken over saves nothing
        background = self.policy.async_save if async_save is None else async_save
        self._beat.enter(CHECKPOINT)
        try:
            handle = engine_state.save(
                self._state(True), save_dir, tag, client_state, group=self.group, writer_group=self._writer_group,
                background=background, create=root not in self._known_roots,
            )  # fmt: skip
        finally:
            # a failed save is tried again at the next interval, not at the next step
            self._last_save = time.monotonic()
            self._beat.leave(self._steps.global_steps, self._steps.micro_steps)
        self._known_roots.add(root)
        self._last_saved = (root, self._steps.micro_steps) if tag is None else None
        if background:
            self._pending, self.saved_in_background = (handle, stops), True
            log.info("checkpoint %s: writing in the background", handle.path)
        else:
            log.info("checkpoint saved: %s", handle.path)
        return str(handle.path)

    def wait(self, *, stops: bool | None = None) -> None:
        """Block until a background save has been written and committed. If it failed: raise its error
        on every rank — or, for a periodic save under checkpoint.on_error "continue", warn."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        handle, pending_stops = pending
        from torch.distributed.checkpoint.api import CheckpointException

        from spikingsail.checkpoint import dcp_io

        try:
            handle.wait()
        except CheckpointError as err:
            failure = err
        except (Exception, CheckpointException) as err:
            failure = CheckpointError(
                f"the background save of {handle.path} failed",
                dcp_io.describe(err),
                "the previous checkpoint is intact and still 'latest'; check free space and permissions",
            )
            failure.__cause__ = err
        else:
            log.info("checkpoint saved: %s", handle.path)
            return
        self._last_saved = None
        if pending_stops if stops is None else stops:
            raise failure
        self._warn_failed_save(failure)

    def _maybe_save(self) -> None:
        policy = self.policy
        assert policy.path is not None
        due = bool(policy.interval_steps) and self._steps.global_steps % policy.interval_steps == 0
        if policy.interval_seconds:
            # Ranks' clocks differ: rank 0's decides, or some ranks would enter the save alone.
            # The flag is made on the collective's device and read back from the tensor the
            # broadcast wrote (on a GPU, ``.to()`` of a CPU tensor is a copy).
            elapsed = torch.tensor(
                [time.monotonic() - self._last_save >= policy.interval_seconds],
                dtype=torch.int32,
                device=self.device,
            )
            if dist.is_initialized():
                dist.broadcast(elapsed, src=0)
            due = due or bool(elapsed.item())
        if not due:
            return
        try:
            self.save(policy.path, stops=policy.on_error == "stop")
        except CheckpointError as err:
            if policy.on_error == "stop":
                raise
            self._warn_failed_save(err)

    def _warn_failed_save(self, err: CheckpointError) -> None:
        """checkpoint.on_error "continue": every rank's log and the metrics file say so; training goes on."""
        log.warning("%s\n  (checkpoint.on_error is 'continue': training goes on, and the next save comes at "
                    "the next interval)", err)  # fmt: skip
        self._report("checkpoint_failed", str(err), self._steps.global_steps)

    def _poll_background_save(self) -> None:
        """A background save that has finished on every rank is settled at the step where all of
        them know it (its failure then surfaces on every rank at the same step)."""
        if not self.saved_in_background:
            return
        finished = self._pending is None or self._pending[0].done.done()
        if dist.is_initialized() and self.rank_info.world_size > 1:
            # every step once a background save was made, pending here or not: a rank that waited
            # for its save alone (wait_for_checkpoint) must still take part
            # the default group, not the checkpoint group: the writer thread may be using that one
            flag = torch.tensor([int(finished)], dtype=torch.int32, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            finished = bool(flag.item())
        if finished and self._pending is not None:
            self.wait()

    def _save_and_exit_for_requeue(self) -> None:
        assert self.policy.path is not None  # the watch is armed only with a path
        root = self.policy.path
        if self._last_saved == (str(Path(root)), self._steps.micro_steps):
            # this step's periodic save holds exactly this state: writing it again would only
            # replace a good checkpoint with the same bytes
            self.wait(stops=True)
            path = str(Path(root) / f"global_step{self._steps.global_steps}")
        else:
            path = self.save(root, async_save=False)
        log.warning("preempted by signal %s: saved %s; exiting with status %d (requeue me)",
                    self.preemption.signal_name, path, PREEMPTED_EXIT_CODE)  # fmt: skip
        self._close_job()
        raise SystemExit(PREEMPTED_EXIT_CODE)

    # -- loading ---------------------------------------------------------------------------------

    def load(
        self, load_dir: str | Path, tag: str | None, *, with_optimizer: bool, module_only: bool
    ) -> tuple[str, dict[str, Any]]:
        """``engine.load_checkpoint``: restore the state ``state()`` names from ``load_dir``."""
        from spikingsail.checkpoint.replica_dirs import checkpoints_to_load

        self.wait()
        self._last_saved = None
        load_dir = self._agreed(str(checkpoints_to_load(load_dir, tag)))
        training = self._state(with_optimizer)
        if module_only:
            path, client_state = engine_state.load_weights(training, load_dir, tag, group=self.group)
            log.info("weights loaded from %s; training starts at step 0", path)
            return str(path), client_state
        self._beat.enter(CHECKPOINT)
        path, client_state = engine_state.load(training, load_dir, tag, group=self.group)
        self._beat.leave(self._steps.global_steps, self._steps.micro_steps)
        return str(path), client_state

    def _agreed(self, choice: str) -> str:
        """Rank 0's ``choice`` on every rank (what rank 0 saw of a directory another replica group may
        be writing to)."""
        if self.replica_group is None or self.rank_info.world_size == 1 or not dist.is_initialized():
            return choice
        chosen = [choice]
        dist.broadcast_object_list(chosen, src=0)
        return str(chosen[0])

    # -- the directory, its lock, the process groups ---------------------------------------------

    def _check_directory(self, root: Path) -> None:
        """Before the first step: every rank can create and write the checkpoint directory (each
        node's, when it is node-local), and it has room for the checkpoints keep_last keeps."""
        who = f"rank {self.rank_info.rank} on {socket.gethostname()}"
        problem = faults.probe(root, create=True, who=who)
        problems = [problem]
        if self.group is not None:
            problems = [None] * self.rank_info.world_size
            dist.all_gather_object(problems, problem, group=self.group)
        found = [p for p in problems if p is not None]
        if found:
            raise CheckpointError(
                f"cannot save checkpoints in {root}: {len(found)} of {len(problems)} rank(s) cannot write there",
                "; ".join(found),
                "make the directory writable by the job's user on every node, or choose another "
                "--checkpoints-path (this is checked before the first step, not at the first save)",
            )
        self._known_roots.add(str(root))
        on_rank_zero(lambda: self._check_room(root), self.rank_info)

    def _check_room(self, root: Path) -> None:
        """Room for keep_last + 1 checkpoints (the one being written), less those already there."""
        keep_last = self.policy.keep_last
        existing = len(CheckpointStore(root).tags())
        copies = max(1, (keep_last or 1) + 1 - min(existing, keep_last or 1))
        training = self._state(True)
        assert training.optimizer is not None  # asked for with the optimizer
        estimate = faults.estimate_bytes(training.module, training.optimizer)
        refusal = faults.check_room(root, estimate, copies)
        if refusal is not None:
            raise refusal

    def _agree_on_lock(self, lock: JobLock | None) -> JobLock | None:
        """Rank 0 takes the lock; every rank learns whether it did, so that a refusal ends every rank."""
        refusal: tuple[str, str, str] | None = None
        if lock is not None:
            try:
                lock.acquire()
            except CheckpointError as err:
                refusal = (err.what, err.why, err.fix)
        if self.group is not None:
            box = [refusal]
            dist.broadcast_object_list(box, src=0, group=self.group)
            refusal = box[0]
        if refusal is not None:
            raise CheckpointError(*refusal)
        return lock

    @property
    def group(self) -> dist.ProcessGroup | None:
        """A gloo group of its own for checkpoint coordination, also from a background thread."""
        return self._process_groups()[0]

    @property
    def _writer_group(self) -> dist.ProcessGroup | None:
        """The group a background save's writer thread uses: while it writes, the ranks agree on
        the save's start in the coordination group (one group used by two threads at once would
        see their collectives in different orders on different ranks)."""
        return self._process_groups()[1]

    def _process_groups(self) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        if not dist.is_initialized():
            return None, None
        if self._groups is None:
            coordination, writer = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")  # all ranks
            assert isinstance(coordination, dist.ProcessGroup) and isinstance(writer, dist.ProcessGroup)
            self._groups = coordination, writer
        return self._groups

    def close(self) -> None:
        """Finish a background save (raising its failure once the rest is down), release the lock and
        leave the checkpoint process groups; calling it twice is harmless."""
        self.preemption.disarm()
        try:
            self.wait()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            if self._groups is not None:
                # now, not at interpreter exit, and also when the default group is the user's
                if dist.is_initialized():
                    for group in self._groups:
                        dist.destroy_process_group(group)
                self._groups = None
