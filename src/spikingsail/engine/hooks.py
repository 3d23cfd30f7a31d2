"""The engine's step as events, and the features that take part in them.

``forward``, ``backward`` and ``step`` do the step's work and, around it, call the hooks of the
features that are on: the hang watch's heartbeat, the straggler breakdown, ``balance``, the monitor,
the spiking-neuron state, replica groups, the checkpointer. A feature that is off registers nothing
and costs nothing; the step path has no branch on any feature.

A feature is an object with methods named after the events it takes part in (all optional)::

    forward_begin()                     engine(batch) starts
    forward_end()                       ... and returns
    backward_begin(loss, boundary)      engine.backward(loss) starts; boundary: it ends a window
    backward_end(boundary)              ... and returns
    step_begin(boundary)                engine.step() starts
    vote() -> bool                      on a window's end, before the optimizer: False takes the step again
    optimizer_end(notes)                after the optimizer step, with the counters moved on (``StepNotes``)
    period_end(notes)                   ... then, at the optimizer steps that are a multiple of the
                                        feature's ``period`` (a report every few steps costs no
                                        call in between)
    discarded()                         the step was not committed (a ``vote`` said False)
    step_end(boundary)                  engine.step() returns

Hooks run in the order their features were added at a ``*_begin`` event and in the reverse order at
an ``*_end`` event, like nested ``with`` blocks: the first feature added (the heartbeat) enters first
and leaves last, so whatever a later feature does at the end of a step happens inside its record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

EVENTS = (
    "forward_begin",
    "forward_end",
    "backward_begin",
    "backward_end",
    "step_begin",
    "vote",
    "optimizer_end",
    "period_end",
    "discarded",
    "step_end",
)
_REVERSED = frozenset(name for name in EVENTS if name.endswith("_end"))


@dataclass(slots=True)
class StepNotes:
    """What an optimizer step's features hand each other at ``optimizer_end`` (one object, reused):
    the step, whether fp16 skipped it, and what ``balance`` and the straggler breakdown found; and,
    from ``backward`` on, the value of the step's last backward's loss (its only one without
    accumulation), without its graph."""

    step: int = 0
    skipped: bool = False
    loss: Any = None
    balance: dict[str, Any] | None = None
    stragglers: dict[str, Any] | None = None
    quorum: int | None = None
    """With replica groups: the torchft quorum that committed the step, when other groups were in it."""


class StepHooks:
    """The registered hooks, a list per event (read by the engine at every step)."""

    __slots__ = (*EVENTS, "features")
    forward_begin: list[Callable[[], None]]
    forward_end: list[Callable[[], None]]
    backward_begin: list[Callable[[Any, bool], None]]
    backward_end: list[Callable[[bool], None]]
    step_begin: list[Callable[[bool], None]]
    vote: list[Callable[[], bool]]
    optimizer_end: list[Callable[[StepNotes], None]]
    period_end: list[tuple[int, Callable[[StepNotes], None]]]
    discarded: list[Callable[[], None]]
    step_end: list[Callable[[bool], None]]

    def __init__(self) -> None:
        for name in EVENTS:
            setattr(self, name, [])
        self.features: list[object] = []

    def add(self, feature: object) -> None:
        """Register every event method ``feature`` has."""
        self.features.append(feature)
        for name in EVENTS:
            method = getattr(feature, name, None)
            if method is None:
                continue
            hooks: list[Any] = getattr(self, name)
            if name == "period_end":
                hooks.append((feature.period, method))  # type: ignore[attr-defined]
            elif name in _REVERSED:
                hooks.insert(0, method)
            else:
                hooks.append(method)

    def remove(self, feature: object) -> None:
        if feature not in self.features:
            return
        self.features.remove(feature)
        for name in EVENTS:
            method = getattr(feature, name, None)
            if method is not None:
                hooks: list[Any] = getattr(self, name)
                hooks[:] = [h for h in hooks if (h[1] if name == "period_end" else h) != method]

    def __contains__(self, feature: object) -> bool:
        return feature in self.features
