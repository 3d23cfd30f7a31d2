"""The checkpoint policy without an engine: a ``Checkpointer`` given a model, an optimizer, a backend's
state format and step counters saves at its interval, in the background, and at a real preemption
signal, and loads back what it saved (one process, real files)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from spikingsail.backends import backend_class, load_config
from spikingsail.checkpoint.checkpointer import Checkpointer
from spikingsail.checkpoint.compatibility import as_saved
from spikingsail.checkpoint.engine_state import TrainingState
from spikingsail.checkpoint.preemption import PREEMPTED_EXIT_CODE
from spikingsail.checkpoint.store import CheckpointStore
from spikingsail.engine.state import StepCounters
from spikingsail.environments import RankInfo
from spikingsail.monitor.heartbeat import NoHeartbeat


class Job:
    """What an engine would hand its checkpointer, and the checkpointer."""

    def __init__(self, root: Path | None, **policy: Any) -> None:
        checkpoint = {"path": str(root), **policy} if root is not None else policy
        self.config = load_config(
            {"train_micro_batch_size_per_gpu": 2, "checkpoint": checkpoint, "sail": {"progress_bar": False}},
            1,
        )
        self.rank_info = RankInfo.single()
        self.backend = backend_class("ddp")(self.config, self.rank_info)
        self.device = self.backend.setup()
        torch.manual_seed(0)
        self.model = torch.nn.Linear(3, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.backend.setup_module_and_optimizer(self.model, self.optimizer, None)  # as the engine does
        self.counters = StepCounters(accumulation=1)
        self.reports: list[tuple[str, str, int]] = []
        self.closed = 0
        self.checkpointer = Checkpointer.start(
            self.config.checkpoint, rank_info=self.rank_info, device=self.device, state=self.state,
            steps=self.counters, beat=NoHeartbeat(), report=lambda *report: self.reports.append(report),
            close_job=self.close_job,
        )  # fmt: skip

    def state(self, with_optimizer: bool) -> TrainingState:
        return TrainingState(module=self.model, optimizer=self.optimizer if with_optimizer else None,
                             backend=self.backend, config=as_saved(self.config),
                             keep_last=self.config.checkpoint.keep_last, rank_info=self.rank_info,
                             device=self.device, states={"counters": self.counters})  # fmt: skip

    def close_job(self) -> None:
        self.closed += 1

    def train_to(self, step: int) -> None:
        """Optimizer steps up to ``step``, each ending as the engine's does: the counters move on, then
        the checkpointer's step hook."""
        while self.counters.global_steps < step:
            self.model(torch.ones(4, 3)).square().sum().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.counters.global_steps += 1
            self.counters.micro_steps += 1
            self.checkpointer.step_end(True)


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    made: list[Job] = []
    yield made
    for job in made:
        job.checkpointer.close()


def test_saves_come_at_the_interval_and_a_load_restores_the_step_and_the_weights(
    tmp_path: Path, jobs: list[Job]
) -> None:
    job = Job(tmp_path / "ck", interval_steps=2)
    jobs.append(job)
    assert job.checkpointer.wants_steps
    job.train_to(5)
    assert CheckpointStore(tmp_path / "ck").tags() == ["global_step2", "global_step4"]
    job.checkpointer.close()  # at step 5: the weights moved on past the checkpoint

    again = Job(tmp_path / "ck")
    jobs.append(again)
    path, _ = again.checkpointer.load(tmp_path / "ck", None, with_optimizer=True, module_only=False)
    assert Path(path).name == "global_step4" and again.counters.global_steps == 4
    reference = Job(None)
    jobs.append(reference)
    reference.train_to(4)
    for key, value in reference.model.state_dict().items():
        torch.testing.assert_close(again.model.state_dict()[key], value, rtol=0, atol=0, msg=key)


def test_a_save_of_a_step_the_interval_saved_is_skipped_with_a_note_or_adds_the_client_state(
    tmp_path: Path, jobs: list[Job], caplog: pytest.LogCaptureFixture
) -> None:
    """engine.save_checkpoint(path) right after the periodic save of the same step writes nothing again
    and says so; with a client_state it saves again (the periodic save had none) and says that."""
    job = Job(tmp_path / "ck", interval_steps=2)
    jobs.append(job)
    job.train_to(2)
    files = {p: p.stat().st_mtime_ns for p in (tmp_path / "ck" / "global_step2").rglob("*")}
    with caplog.at_level("INFO", logger="spikingsail.checkpoint.checkpointer"):
        path = job.checkpointer.save(tmp_path / "ck")
    assert path == str(tmp_path / "ck" / "global_step2")
    assert "saved at this step already (checkpoint.interval_*); not saved again" in caplog.text
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "ck" / "global_step2").rglob("*")} == files
    caplog.clear()
    with caplog.at_level("INFO", logger="spikingsail.checkpoint.checkpointer"):
        job.checkpointer.save(tmp_path / "ck", client_state={"best": 0.5})
    assert "saved again, now with client_state" in caplog.text
    _, client_state = job.checkpointer.load(tmp_path / "ck", None, with_optimizer=True, module_only=False)
    assert client_state == {"best": 0.5}
    assert CheckpointStore(tmp_path / "ck").tags() == ["global_step2"]


def test_a_background_save_is_settled_at_a_step_and_commits(tmp_path: Path, jobs: list[Job]) -> None:
    job = Job(tmp_path / "ck", save_on_preemption=False)
    jobs.append(job)
    assert not job.checkpointer.wants_steps  # no interval, no preemption watch: no step hook to run
    job.train_to(1)
    path = job.checkpointer.save(tmp_path / "ck", async_save=True)
    assert job.checkpointer.wants_steps  # from now on every step asks whether it has finished
    job.checkpointer.wait()
    assert Path(path).name == "global_step1" and CheckpointStore(tmp_path / "ck").latest() == "global_step1"
    assert job.reports == []


def test_a_preemption_signal_saves_this_step_and_exits_for_a_requeue(tmp_path: Path, jobs: list[Job]) -> None:
    job = Job(tmp_path / "ck")
    jobs.append(job)
    job.train_to(2)
    os.kill(os.getpid(), signal.SIGUSR1)
    with pytest.raises(SystemExit) as exit_info:
        job.train_to(3)
    assert exit_info.value.code == PREEMPTED_EXIT_CODE and job.closed == 1
    assert CheckpointStore(tmp_path / "ck").latest() == "global_step3"
