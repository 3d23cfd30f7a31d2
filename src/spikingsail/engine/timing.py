"""Timestamps of this rank's own work: a clock that is right on a GPU, and the moment a backward's
last gradient is ready (what follows it is the wait for the other ranks); and how much a ratio of two
ranks' mean step times can be trusted, given how much their steps vary.

The straggler alarm and ``balance: auto`` judge ranks by these ratios. On a shared machine a rank's
step time varies from step to step (other processes, a CPU quota's periods, the page cache), and a
window's mean carries that spread: a difference counts only where it is larger than ``Z`` standard
errors of the ratio, estimated from the steps themselves.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class Clock:
    """Wall-clock marks on a CPU; CUDA events on a GPU, where the host runs ahead of the kernels.
    On a CPU ``mark`` is ``time.perf_counter`` itself: the step's hooks read it several times a step."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.mark: Callable[[], Any] = self._event if cuda else time.perf_counter

    @staticmethod
    def _event() -> Any:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return float(start.elapsed_time(end)) / 1000.0
        return float(end - start)


class LastGradient:
    """When this rank's own work in a backward ends: a ``post_accumulate_grad`` hook marks the moment
    a gradient is ready, so the last mark is the end of the rank's compute; whatever backward takes
    after it (DDP's and Horovod's all-reduce finishing) is the wait for the slowest rank's gradients.

    The first backward hooks every parameter and notes which one's gradient came last; from then on
    only that one is hooked (a static graph readies its gradients in the same order every time:
    one hook call a backward instead of one per parameter). A backward that leaves it without a
    gradient (a branch not taken) hooks every parameter again for the next one."""

    def __init__(self, model: nn.Module, clock: Clock) -> None:
        self.clock = clock
        self.in_backward = False
        self.mark: Any = None
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._last: torch.Tensor | None = None
        self._handles: list[Any] = []
        self._hook(self._params)

    def _hook(self, params: Sequence[torch.Tensor]) -> None:
        self.remove()
        self._handles = [
            p.register_post_accumulate_grad_hook(self._ready)  # type: ignore[no-untyped-call]
            for p in params
        ]
        self.learning = len(params) > 1
        """Every parameter is hooked: this backward tells which one's gradient comes last."""

    def _ready(self, param: torch.Tensor) -> None:
        if self.in_backward:
            self.mark = self.clock.mark()
            self._last = param

    def begin(self) -> None:
        self.in_backward, self.mark = True, None

    def end(self) -> Any:
        """The last gradient's mark, or None when nothing in the backward needed one."""
        self.in_backward = False
        if self.learning or self.mark is None:
            self.learnt()
        return self.mark

    def learnt(self) -> None:
        """After a backward: with every parameter hooked, keep only the last one's hook; when the one
        hooked got no gradient, hook them all again."""
        if self.learning and self._last is not None:
            self._hook([self._last])
        elif self.mark is None and not self.learning:
            self._hook(self._params)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class ComputeTimer:
    """This rank's compute time between two optimizer steps: the step's time less the time it
    waited for the other ranks at the end of backward (where DDP and Horovod finish their
    all-reduce), and the samples it trained on.

    The wait is what backward takes after this rank's last gradient (``LastGradient``). Time spent
    in the engine's own collective at the step boundary is outside the window too.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.clock = Clock(device.type == "cuda")
        self.samples = 0
        self.last_gradient = LastGradient(model, self.clock)
        self._waits: list[tuple[Any, Any]] = []
        self._start = self.clock.mark()

    def begin_backward(self) -> None:
        self.last_gradient.begin()

    def end_backward(self) -> None:
        last = self.last_gradient.end()
        if last is not None:
            self._waits.append((last, self.clock.mark()))

    def take(self) -> tuple[float, int, float]:
        """(compute seconds, samples, wall seconds) since the last ``restart``."""
        step = self.clock.seconds(self._start, self.clock.mark())
        waited = sum(self.clock.seconds(a, b) for a, b in self._waits)
        out = (max(step - waited, 1e-9), self.samples, step)
        self._waits.clear()
        self.samples = 0
        return out

    def restart(self) -> None:
        self._start = self.clock.mark()

    def remove(self) -> None:
        self.last_gradient.remove()


Z = 3.0
"""Standard errors by which a measured ratio must pass a threshold to count (one-sided: about 1 in
700 for a normal mean; a window's steps are not independent draws, so wider than the textbook 2)."""


def spread(values: list[float]) -> tuple[float, float]:
    """(sum, sum of squared deviations from the mean) of one rank's per-step values: what the ranks
    all-reduce, so that every rank can tell each rank's mean and its standard error."""
    total = math.fsum(values)
    mean = total / len(values) if values else 0.0
    return total, math.fsum([(v - mean) ** 2 for v in values])


def log_variance_of_mean(total: float, deviations: float, count: float) -> float:
    """The variance of the log of a mean of ``count`` values (their ``spread``), by the delta method:
    (standard error ÷ mean)². 0 where one value gives no spread to judge by."""
    if count < 2 or total <= 0:
        return 0.0
    variance_of_mean = deviations / (count - 1) / count
    return variance_of_mean / (total / count) ** 2


def lower_bound(ratio: float, log_variance: float, z: float = Z) -> float:
    """The ratio's lower confidence bound: ``z`` standard errors below it, in log space (a ratio's
    error is multiplicative)."""
    return ratio * math.exp(-z * math.sqrt(max(log_variance, 0.0)))


def fractions(speeds: list[float]) -> list[float]:
    """Each rank's share of the total speed."""
    total = math.fsum(speeds)
    return [s / total for s in speeds]


Step = list[list[float]]
"""One optimizer step's all-reduced rows: per rank, (compute seconds, samples, wall seconds)."""


@dataclass
class SpeedMeasure:
    """Each rank's samples per second of compute over some steps, and the variance of its log."""

    speeds: list[float]
    variances: list[float]

    @staticmethod
    def sums(steps: Sequence[Step], out: list[list[float]] | None = None) -> list[list[float]]:
        """Per rank, what a measure is made of, summed over ``steps`` (added to ``out``): Σ seconds,
        Σ samples, Σ seconds², Σ seconds × samples, Σ samples², steps (plain floats: a handful a step)."""
        if out is None:
            out = [[0.0] * 6 for _ in steps[0]] if steps else []
        for step in steps:
            for total, (c, n, *_) in zip(out, step, strict=True):
                for i, x in enumerate((c, n, c * c, c * n, n * n, 1.0)):
                    total[i] += x
        return out

    @staticmethod
    def of(sums: list[list[float]]) -> SpeedMeasure:
        """The throughput over the steps (a rank that stalls now and then, a throttled or shared
        device, is as slow as its stalls make it, which a median of steps would hide), and the
        variance of its log as a ratio estimator's: the steps' residuals about it, Σ (nᵢ − R cᵢ)²
        ÷ (k − 1), over k · (mean seconds × R)²."""
        speeds, variances = [], []
        for seconds, samples, c2, cn, n2, k in sums:
            speed = samples / max(seconds, 1e-12)
            speeds.append(speed)
            residuals = max(n2 - 2 * speed * cn + speed * speed * c2, 0.0)
            ok = k >= 2 and speed > 0 and seconds > 0
            variances.append(residuals / (k - 1) / k / (seconds / k * speed) ** 2 if ok else 0.0)
        return SpeedMeasure(speeds, variances)

    @staticmethod
    def of_steps(steps: Sequence[Step]) -> SpeedMeasure:
        return SpeedMeasure.of(SpeedMeasure.sums(steps))

    def fraction_variances(self) -> list[float]:
        """The variance of the log of each rank's share of the total speed (independent ranks):
        d log fᵣ = (1 − fᵣ) d log sᵣ − Σⱼ≠ᵣ fⱼ d log sⱼ."""
        shares = fractions(self.speeds)
        return [
            (1 - shares[r]) ** 2 * self.variances[r]
            + math.fsum(
                f * f * v for j, (f, v) in enumerate(zip(shares, self.variances, strict=True)) if j != r
            )
            for r in range(len(shares))
        ]


def cuts(steps: Sequence[Step], least: int) -> Iterator[tuple[SpeedMeasure, SpeedMeasure]]:
    """(earlier, later): the measures of ``steps`` cut in two at every place that leaves at least
    ``least`` steps on each side, from running sums kept from each end (the whole's sums less the
    earlier side's would keep the rounding of a long step's square among short ones' as spread)."""
    if len(steps) < 2 * least:
        return
    later: dict[int, SpeedMeasure] = {}  # at each cut that leaves ``least`` steps before it
    running = [[0.0] * 6 for _ in steps[0]]
    for cut in range(len(steps) - 1, least - 1, -1):
        SpeedMeasure.sums([steps[cut]], running)
        if cut <= len(steps) - least:
            later[cut] = SpeedMeasure.of(running)
    before = [[0.0] * 6 for _ in steps[0]]
    for cut in range(1, len(steps) - least + 1):
        SpeedMeasure.sums([steps[cut - 1]], before)
        if cut >= least:
            yield SpeedMeasure.of(before), later[cut]
