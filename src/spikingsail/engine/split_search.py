"""How ``balance: auto`` searches for its split beyond the proportional one: bounds on each rank's
even share from the splits measured so far, and probes of the split in use against a neighbour by
their steps' wall time.

``ShareBounds``: a rank whose compute at a split took longer than an even split's would, with
confidence, has its even share below its share there; one that took less, above. A new split keeps
every rank's share within its bounds, so where time is not in proportion to the share (a fixed cost
per step, a CPU quota's periods) the split narrows in on even times instead of swinging across them;
and it moves each speed one standard error towards the split in use, no further than the
measurement supports.

``Probe``: compute times even out the ranks' work, but what a step costs also depends on how the ranks' work
and waits fall together (a CPU quota's periods, two processes sharing cores, the overlap of the
all-reduce with backward), which only the step's own time shows. A probe moves ``PROBE_FRACTION``
of the slowest rank's share to or from the fastest rank and runs the two splits in turns of
``PROBE_STEPS`` steps, ``PROBE_ROUNDS`` turns each, so that a change of the machine's load meets both
alike; the neighbour is faster when its mean step is shorter by ``PROBE_MARGIN`` with confidence
(``Z`` standard errors, from the steps' own spread), slower when it is longer with confidence, and
else the steps could not tell.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from spikingsail.data.sampler import split_batch
from spikingsail.engine.timing import SpeedMeasure, Step, Z, log_variance_of_mean, lower_bound, spread

log = logging.getLogger(__name__)

PROBE_FRACTION = 0.08
"""A probe moves this fraction of the slowest rank's share (at least one sample) to or from the fastest."""
PROBE_STEPS = 4
"""Steps a probed split runs before the other one of the pair takes over."""
PROBE_ROUNDS = 4
"""Turns of each split in one comparison: ``2 × PROBE_ROUNDS × PROBE_STEPS`` steps, the two splits
interleaved so that a change of the machine's load meets both alike."""
PROBE_MARGIN = 0.03
"""How much faster (steps per second) a neighbour must run to be kept."""
PROBE_MOVES = 3
"""Neighbours kept one after another in one probe, at most."""


@dataclass
class Probe:
    """A comparison of the split in use (``base``) with a neighbour, by the wall time of their steps."""

    start: list[int]
    """The split before the probe: where a probe that keeps no neighbour ends."""
    base: list[int]
    candidate: list[int]
    direction: int
    """-1: the slowest rank gives samples to the fastest; +1: it takes some."""
    kept: int = 0
    unsure: bool = False
    """An earlier comparison of this probe found no neighbour slower, with confidence."""
    turns: int = 0
    """Turns (of ``PROBE_STEPS`` steps) done in this comparison; even: the candidate's."""
    turn: list[Step] = field(default_factory=list)
    """This turn's per-step all-reduced rows."""
    walls: dict[bool, list[float]] = field(default_factory=lambda: {False: [], True: []})
    """Every step's wall time (the slowest rank's) under the base (False) and the candidate (True)."""
    totals: dict[bool, list[Step]] = field(default_factory=lambda: {False: [], True: []})
    """The per-step rows of the base's (False) and the candidate's (True) turns."""

    @staticmethod
    def around(
        start: list[int],
        base: list[int],
        direction: int,
        kept: int,
        speeds: list[float],
        unsure: bool = False,
    ) -> Probe | None:
        """``base`` against its neighbour in ``direction``; None when it has none."""
        ranks = range(len(base))
        slow, fast = min(ranks, key=lambda r: speeds[r]), max(ranks, key=lambda r: speeds[r])
        delta = max(1, round(PROBE_FRACTION * base[slow]))
        candidate = list(base)
        candidate[slow] += direction * delta
        candidate[fast] -= direction * delta
        if slow == fast or min(candidate) < 1:
            return None
        return Probe(start, base, candidate, direction, kept, unsure)

    @property
    def split(self) -> list[int]:
        """The split of the turn under way."""
        return self.candidate if self.turns % 2 == 0 else self.base

    @property
    def done(self) -> bool:
        return self.turns >= 2 * PROBE_ROUNDS

    def add(self, both: Step) -> SpeedMeasure | None:
        """One step's all-reduced rows; at a turn's end, the speeds measured over the turn."""
        candidate = self.turns % 2 == 0
        self.turn.append(both)
        self.walls[candidate].append(max(row[2] for row in both))  # the step waits for the slowest rank
        if len(self.turn) < PROBE_STEPS:
            return None
        turn, self.turn = self.turn, []
        self.turns += 1
        self.totals[candidate].extend(turn)
        return SpeedMeasure.of_steps(turn)

    def verdict(self, step: int, rank: int) -> tuple[bool, bool]:
        """(the candidate ran faster by the margin, it ran slower), each with confidence: a
        neighbour that only seems faster on a noisy machine is not worth a move."""
        base, candidate = spread(self.walls[False]), spread(self.walls[True])
        count = len(self.walls[False])
        gain = base[0] / max(candidate[0], 1e-12)
        variance = log_variance_of_mean(*base, count) + log_variance_of_mean(*candidate, count)
        if rank == 0:
            log.debug("balance probe at step %d: steps %.3f× faster at %s than at %s", step,
                      gain, self.candidate, self.base)  # fmt: skip
        return lower_bound(gain, variance) > 1 + PROBE_MARGIN, lower_bound(1 / gain, variance) > 1


class ShareBounds:
    """Per rank, the open interval its even share lies in, as the splits measured so far show it."""

    def __init__(self, total: int, world_size: int) -> None:
        self.total = total
        self.world_size = world_size
        self.reset()

    def reset(self) -> None:
        """A new situation (a rank's speed moved by the factor, a probe's correction): no bounds."""
        self.bounds = [(0.0, self.total + 1.0)] * self.world_size

    def learn(self, split: list[int], measure: SpeedMeasure) -> None:
        """Narrow the bounds by ``split`` and the (corrected) speeds measured at it. A bound that
        contradicts the new one is older, and is dropped."""
        even = self.total / max(math.fsum(measure.speeds), 1e-12)
        variances = measure.fraction_variances()
        for r, (n, speed, variance) in enumerate(zip(split, measure.speeds, variances, strict=True)):
            low, high = self.bounds[r]
            gap, margin = math.log(max(n / max(speed, 1e-12), 1e-12) / even), Z * math.sqrt(variance)
            if gap - margin > 0:
                low, high = (low if low < n else 0.0), n
            elif gap + margin < 0:
                low, high = n, (high if high > n else self.total + 1.0)
            self.bounds[r] = (low, high)

    def target(self, split: list[int], measure: SpeedMeasure) -> list[int]:
        """The split the (corrected) speeds give, each one standard error nearer to the speed that
        would make ``split`` even, and each rank's share within its bounds (their middle where the
        speeds lead out of them); ``split`` itself where the shares would still fall outside."""
        total = math.fsum(measure.speeds)
        speeds = []
        for n, speed, variance in zip(split, measure.speeds, measure.variances, strict=True):
            width = math.exp(math.sqrt(variance))
            speeds.append(min(max(n / self.total * total, speed / width), speed * width))
        shares = [self.total * s / math.fsum(speeds) for s in speeds]
        shares = [
            x if low < x < high else (low + high) / 2
            for x, (low, high) in zip(shares, self.bounds, strict=True)
        ]
        new = split_batch(self.total, shares)
        if any(not low < n < high for n, (low, high) in zip(new, self.bounds, strict=True)):
            return list(split)
        return new
