"""The engine's step events as a feature sees them (``engine/hooks.py``), on a real single-process
engine: their order, the nesting of begin and end events, ``period_end`` only at the steps that are
due, and what ``StepNotes`` carries."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import spikingsail
from spikingsail.engine.hooks import StepNotes
from spikingsail.environments import RankInfo


class Recorder:
    """A feature that takes part in every event and writes down what it saw."""

    def __init__(self, name: str, seen: list[tuple[Any, ...]], period: int = 1) -> None:
        self.name, self.seen, self.period = name, seen, period

    def forward_begin(self) -> None:
        self.seen.append((self.name, "forward_begin"))

    def forward_end(self) -> None:
        self.seen.append((self.name, "forward_end"))

    def backward_begin(self, loss: torch.Tensor, boundary: bool) -> None:
        self.seen.append((self.name, "backward_begin", boundary))

    def backward_end(self, boundary: bool) -> None:
        self.seen.append((self.name, "backward_end", boundary))

    def step_begin(self, boundary: bool) -> None:
        self.seen.append((self.name, "step_begin", boundary))

    def optimizer_end(self, notes: StepNotes) -> None:
        self.seen.append((self.name, "optimizer_end", notes.step))

    def period_end(self, notes: StepNotes) -> None:
        self.seen.append((self.name, "period_end", notes.step))

    def step_end(self, boundary: bool) -> None:
        self.seen.append((self.name, "step_end", boundary))


def engine_for(accumulation: int) -> spikingsail.Engine:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "steps_per_print": 2,
        "sail": {"progress_bar": False},
    }
    model = torch.nn.Linear(4, 2)
    engine, _ = spikingsail.initialize(model=model, config=config, rank_info=RankInfo.single())
    return engine


def micro_step(engine: spikingsail.Engine) -> torch.Tensor:
    loss = F.cross_entropy(engine(torch.randn(2, 4)), torch.tensor([0, 1]))
    engine.backward(loss)
    engine.step()
    return loss


def test_begin_events_run_in_the_order_features_were_added_and_end_events_in_reverse() -> None:
    engine, seen = engine_for(1), []
    outer, inner = Recorder("outer", seen), Recorder("inner", seen)
    engine.hooks.add(outer)
    engine.hooks.add(inner)
    micro_step(engine)
    engine.close()
    assert seen == [
        ("outer", "forward_begin"), ("inner", "forward_begin"),
        ("inner", "forward_end"), ("outer", "forward_end"),
        ("outer", "backward_begin", True), ("inner", "backward_begin", True),
        ("inner", "backward_end", True), ("outer", "backward_end", True),
        ("outer", "step_begin", True), ("inner", "step_begin", True),
        ("inner", "optimizer_end", 1), ("outer", "optimizer_end", 1),
        ("outer", "period_end", 1), ("inner", "period_end", 1),
        ("inner", "step_end", True), ("outer", "step_end", True),
    ]  # fmt: skip


@pytest.mark.parametrize("accumulation", [1, 3])
def test_period_end_runs_at_the_optimizer_steps_that_are_a_multiple_of_the_period_after_optimizer_end(
    accumulation: int,
) -> None:
    engine, seen = engine_for(accumulation), []
    every, third = Recorder("every", seen), Recorder("third", seen, period=3)
    engine.hooks.add(every)
    engine.hooks.add(third)
    for _ in range(7 * accumulation):
        micro_step(engine)
    engine.hooks.remove(third)
    for _ in range(3 * accumulation):
        micro_step(engine)
    engine.close()
    ends = [(name, event, rest[0]) for name, event, *rest in seen if event in ("optimizer_end", "period_end")]
    assert [e for e in ends if e[1] == "period_end" and e[0] == "third"] == [
        ("third", "period_end", 3), ("third", "period_end", 6)
    ]  # fmt: skip
    assert [e[2] for e in ends if e[1] == "period_end" and e[0] == "every"] == list(range(1, 11))
    for step in (3, 6):  # after every optimizer_end of its step
        at = [e for e in ends if e[2] == step]
        assert at.index(("third", "period_end", step)) > at.index(("every", "optimizer_end", step))


def test_the_notes_carry_the_last_backwards_loss_value_and_the_monitor_prints_it_at_its_period(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine, seen = engine_for(1), []
    notes: list[Any] = []
    probe = Recorder("probe", seen)
    probe.optimizer_end = lambda n: notes.append(n.loss)  # type: ignore[method-assign]
    engine.hooks.add(probe)
    with caplog.at_level(logging.INFO, logger="spikingsail"):
        losses = [micro_step(engine) for _ in range(4)]
    engine.close()
    # the loss's value without its graph, which the engine (alive until the interpreter's exit)
    # must not keep
    for note, loss in zip(notes, losses, strict=True):
        assert note.grad_fn is None and not note.requires_grad and loss.grad_fn is not None
        assert note.data_ptr() == loss.data_ptr() and torch.equal(note, loss.detach())
    lines = [r for r in caplog.records if r.name == "spikingsail.monitor.steps"]
    assert [r.getMessage().split()[:4] for r in lines] == [
        ["step", "2", "loss", f"{losses[1].item():.4f}"],
        ["step", "4", "loss", f"{losses[3].item():.4f}"],
    ]
    assert all(r.funcName == "on_step" for r in lines)


def test_with_accumulation_the_printed_loss_is_the_mean_of_the_steps_micro_batches(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = engine_for(3)
    with caplog.at_level(logging.INFO, logger="spikingsail"):
        losses = [micro_step(engine).item() for _ in range(12)]
    engine.close()
    lines = [r.getMessage().split()[:4] for r in caplog.records if r.name == "spikingsail.monitor.steps"]
    assert lines == [
        ["step", "2", "loss", f"{sum(losses[3:6]) / 3:.4f}"],
        ["step", "4", "loss", f"{sum(losses[9:12]) / 3:.4f}"],
    ]
