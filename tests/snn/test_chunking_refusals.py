"""snn.time_chunk is exact or refused before the first step: models that are not local in time.

Each model here is compared with itself unchunked: either the engine refuses it at the first
forward (no optimizer step taken, the weights as they were) naming the part that is not local in
time, or its chunked gradients equal the unchunked ones (rtol 1e-5, atol 1e-6, as test_chunking).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from spikingjelly.activation_based import base, functional, layer
from torch import nn

import spikingsail
from spikingsail.environments import RankInfo
from spikingsail.errors import ConfigError
from tests.snn.models import lif
from tests.snn.test_chunking import ATOL, RTOL, Masked, T, chunked, gradients

N, FEATURES = 6, 5


class TemporalMean(nn.Module):
    """Adds each sample's mean over all T steps to every step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.mean(0, keepdim=True)


class TemporalAttention(nn.Module):
    """Self-attention across the T steps of each sample, then a projection."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(features, 3 * features)
        self.out = nn.Linear(features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, N, C]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = torch.einsum("tnc,snc->nts", q, k).softmax(-1)
        return self.out(torch.einsum("nts,snc->tnc", weights, v))


class TemporalConv(nn.Module):
    """A Conv1d along T (kernel 3, padded): each step reads its neighbours."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(features, features, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, N, C] -> [N, C, T] and back
        return self.conv(x.permute(1, 2, 0)).permute(2, 0, 1)


class BatchMajorLinear(nn.Module):
    """Local in time, but laid out [N, T, C] inside: what the check must not take for time mixing."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.transpose(0, 1)).transpose(0, 1)


class Counting(nn.Module):
    """Counts its calls in a buffer and leaves its input alone: only the buffer differs in chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def around(middle: nn.Module) -> nn.Module:
    """Linear → LIF → ``middle`` → Linear → LIF, in multi-step mode."""
    torch.manual_seed(0)
    net = nn.Sequential(layer.Linear(FEATURES, 8), lif(), middle, layer.Linear(8, 3), lif())
    functional.set_step_mode(net, "m")
    return net


class Tutorial(nn.Module):
    """spikingjelly's tutorial shape: forward takes [N, ...], repeats it over T inside, averages over T."""

    def __init__(self, time_steps: int, through_time: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.time_steps = time_steps
        self.body = nn.Sequential(
            layer.Conv2d(1, 4, 3, padding=1, bias=False),
            layer.BatchNormThroughTime2d(time_steps, 4) if through_time else nn.Identity(),
            lif(),
            layer.Flatten(),
            layer.Linear(4 * 4 * 4, 3),
            lif(),
        )
        functional.set_step_mode(self, "m")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_seq = x.unsqueeze(0).repeat(self.time_steps, *([1] * x.dim()))
        return self.body(x_seq).mean(0)


def steps(n: int = N) -> torch.Tensor:
    return torch.rand(T, n, FEATURES, generator=torch.Generator().manual_seed(4)) * 3


def images(n: int) -> torch.Tensor:
    return torch.rand(n, 1, 4, 4, generator=torch.Generator().manual_seed(4)) * 3


MIXING: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "temporal mean": (lambda: around(TemporalMean()), r"module '2' \(TemporalMean\) mixes time steps"),
    "temporal attention": (
        lambda: around(TemporalAttention(8)),
        r"the forward of '2' \(TemporalAttention\) mixes time steps between the modules it calls",
    ),
    "temporal conv": (lambda: around(TemporalConv(8)), r"module '2\.conv' \(Conv1d\) mixes time steps"),
}


def assert_chunks_would_differ(net: nn.Module, k: int) -> None:
    """The refusal is not a formality: in chunks, without the check, the gradients are not the model's."""
    _, grads = gradients(copy.deepcopy(net), steps())
    wrapped = chunked(copy.deepcopy(net), k)
    wrapped.checkpoint_fn.func._checked = True  # as if checked: what training computed before the check
    _, chunked_grads = gradients(wrapped, steps())
    assert any(
        not torch.allclose(g, c, rtol=RTOL, atol=ATOL) for g, c in zip(grads, chunked_grads, strict=True)
    )


@pytest.mark.parametrize("name", list(MIXING))
@pytest.mark.parametrize("k", [1, 3])
def test_a_module_that_mixes_time_steps_is_refused_naming_it(name: str, k: int) -> None:
    build, message = MIXING[name]
    net = build()
    assert_chunks_would_differ(net, k)
    with pytest.raises(ConfigError, match=message) as error:
        chunked(net, k)(steps())
    assert "snn.time_chunk is" in str(error.value) and "fix:" in str(error.value)


def silent(middle: nn.Module) -> nn.Module:
    """``around(middle)`` whose first neurons never fire on positive input: ``middle`` sees zeros."""
    net = around(middle)
    with torch.no_grad():
        net[0].weight.copy_(-net[0].weight.abs())
        net[0].bias.fill_(-0.1)
    return net


def test_a_mixing_module_behind_neurons_that_do_not_fire_yet_is_refused() -> None:
    """A mean over all-zero spikes is the same in chunks, its gradient is not: the check's neurons
    fire smoothly (the surrogate's primitive), so the mean sees values that differ over time."""
    net = silent(TemporalMean())
    with torch.no_grad():
        assert not net[:2](steps()).any()  # no spike reaches the mean
    functional.reset_net(net)
    assert_chunks_would_differ(net, 3)
    with pytest.raises(ConfigError, match=r"module '2' \(TemporalMean\) mixes time steps"):
        chunked(net, 3)(steps())


class Binary(nn.Module):
    """Accepts spikes only (0 or 1): the check's smooth neurons make it fail, so it checks spikes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not ((x == 0) | (x == 1)).all():
            raise ValueError("not spikes")
        return x


def test_a_model_that_needs_binary_spikes_is_checked_with_spikes() -> None:
    net = around(Binary())
    out, grads = gradients(copy.deepcopy(net), steps())
    out_chunked, grads_chunked = gradients(chunked(net, 3), steps())
    assert torch.equal(out_chunked, out)
    for g, g_chunked in zip(grads, grads_chunked, strict=True):
        torch.testing.assert_close(g_chunked, g, rtol=RTOL, atol=ATOL)
    with pytest.raises(ConfigError, match=r"module '2\.1' \(TemporalMean\) mixes time steps"):
        chunked(around(nn.Sequential(Binary(), TemporalMean())), 3)(steps())


@pytest.mark.parametrize("through_time", [False, True])
@pytest.mark.parametrize("n", [N, T])  # T samples: the batch's length is the number of steps
def test_the_tutorial_shape_is_refused_naming_the_shape_and_the_fix(through_time: bool, n: int) -> None:
    net = Tutorial(T, through_time)
    with pytest.raises(ConfigError, match=r"the model's first argument is not its time axis") as error:
        chunked(net, 3)(images(n))
    assert f"of its input {(n, 1, 4, 4)}" in str(error.value)
    assert "engine.encode(x)" in str(error.value) and "firing_rate" in str(error.value)


class Positions(nn.Module):
    """Adds a learned embedding per time step: it runs on exactly T steps, never on a chunk."""

    def __init__(self, time_steps: int, features: int) -> None:
        super().__init__()
        self.embedding = nn.Parameter(torch.rand(time_steps, 1, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.embedding


def test_a_model_that_runs_on_exactly_t_steps_is_refused_not_a_traceback() -> None:
    with pytest.raises(ConfigError, match=r"the model fails when called on 6 of the 8 time steps") as error:
        chunked(around(Positions(T, 8)), 3)(steps())
    assert "RuntimeError" in str(error.value) and "fix:" in str(error.value)


def test_a_model_that_fails_on_any_steps_fails_with_its_own_error() -> None:
    """Not blamed on the chunks: a model broken whatever T raises what its own forward raises."""
    net = around(nn.Linear(7, 8))  # takes 7 features where the layer before gives 8
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        chunked(net, 3)(steps())


def test_a_buffer_changed_on_every_call_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"buffer '2\.calls' ends the first micro-batch's forward"):
        chunked(around(Counting()), 3)(steps())


@pytest.mark.parametrize("middle", [BatchMajorLinear, Masked])
def test_models_local_in_time_are_accepted_and_exact(middle: Callable[[int], nn.Module]) -> None:
    """A [N, T, C] layout inside a module, and a fixed buffer (spikingjelly's all-buffers path)."""
    net = around(middle(8))
    out, grads = gradients(copy.deepcopy(net), steps())
    out_chunked, grads_chunked = gradients(chunked(net, 3), steps())
    torch.testing.assert_close(out_chunked, out, rtol=RTOL, atol=ATOL)
    assert any(g.abs().sum() > 0 for g in grads)
    for g, g_chunked in zip(grads, grads_chunked, strict=True):
        torch.testing.assert_close(g_chunked, g, rtol=RTOL, atol=ATOL)


def test_the_check_leaves_the_model_and_the_rng_as_they_were() -> None:
    """After a refusal: the neuron state, the buffers, the train/eval modes and the RNG are untouched."""
    net = around(TemporalMean())
    net.insert(1, layer.BatchNorm1d(8))
    net[1].eval()  # frozen: not refused as batch norm; the check puts its train mode back as it found it
    net.append(layer.SeqToANNContainer(nn.Dropout(0.5)))
    functional.set_step_mode(net, "m")
    before = {k: v.clone() for k, v in net.state_dict().items()}
    modes = [m.training for m in net.modules()]
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with pytest.raises(ConfigError, match=r"module '3' \(TemporalMean\) mixes time steps"):
        chunked(net, 3)(steps())
    assert torch.equal(torch.rand(3), expected)
    assert [m.training for m in net.modules()] == modes and net[-1][0].training and not net[1].training
    for key, value in net.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(v == 0.0 for v in base.extract_memories(net) if not isinstance(v, torch.Tensor))


ADAM = {"optimizer": {"type": "Adam", "params": {"lr": 0.01}}}


@pytest.mark.parametrize(
    ("build", "x", "message"),
    [
        (lambda: around(TemporalMean()), steps, "mixes time steps"),
        (lambda: around(TemporalAttention(8)), steps, "mixes time steps"),
        (lambda: around(TemporalConv(8)), steps, "mixes time steps"),
        (lambda: Tutorial(T, False), lambda: images(N), "not its time axis"),
        (lambda: Tutorial(T, True), lambda: images(N), "not its time axis"),
    ],
    ids=["mean", "attention", "conv", "tutorial", "tutorial-bntt"],
)
def test_the_engine_refuses_at_the_first_forward_before_any_step(
    build: Callable[[], nn.Module], x: Callable[[], torch.Tensor], message: str
) -> None:
    net = build()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": N, **ADAM, "sail": {"progress_bar": False},
                              "snn": {"step_mode": "m", "time_chunk": 3}}  # fmt: skip
    engine, _ = spikingsail.initialize(model=net, config=config, rank_info=RankInfo.single())
    try:
        with pytest.raises(ConfigError, match=message):
            engine(x())
        assert engine.global_steps == 0
        for key, value in engine.module.state_dict().items():
            assert torch.equal(value, before[key]), key
    finally:
        engine.close()


@contextlib.contextmanager
def compiled_engine(net: nn.Module, modules: list[str]) -> Iterator[tuple[Any, Any]]:
    """An engine with ``time_chunk`` 3 whose model (or ``modules`` of it) torch.compile compiles with
    its eager backend, and dynamo's counters, from zero."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": N, **ADAM, "sail": {"progress_bar": False},
                              "snn": {"step_mode": "m", "time_chunk": 3},
                              "compile": {"enabled": True, "backend": "eager", "modules": modules}}  # fmt: skip
    engine, _ = spikingsail.initialize(model=net, config=config, rank_info=RankInfo.single())
    try:
        yield engine, counters
    finally:
        engine.close()
        torch._dynamo.reset()


@pytest.mark.parametrize("modules", [[], ["Linear"]], ids=["model", "modules"])
def test_a_compiled_engine_checks_its_chunks_eagerly_and_refuses_the_same(modules: list[str]) -> None:
    """Under torch.compile the check runs outside the compiled graphs, and so do the compiled modules
    it calls (tracing its hooks and its two forwards, or compiling the modules again for its no-grad
    shapes, costs more than the training step's own compilation: minutes on a CPU), and it refuses as
    it does eagerly."""
    with compiled_engine(around(TemporalMean()), modules) as (engine, counters):
        with pytest.raises(ConfigError, match="mixes time steps"):
            engine(steps())
        assert engine.global_steps == 0
        # traced, the check's hooks, generators and context managers break it into dozens of frames
        # (57 here, with resume functions inside its own); eagerly, the engine's forward up to the
        # check is 2 (the whole model compiled) or none (its Linear layers: the check calls them)
        frames = counters["frames"]["total"]
        resumed = [name for name in counters["resumes"] if "__call__" not in name]
        assert frames == (0 if modules else 2) and not resumed, (dict(counters["frames"]), resumed)


def test_a_compiled_engine_does_not_compile_again_once_its_chunks_are_checked() -> None:
    """The check's flag is read outside the compiled forward: torch.compile guards on what it traces,
    and a flag read there (False at the first step) made it compile the model again at the second."""
    with compiled_engine(around(nn.Identity()), []) as (engine, counters):
        frames = []
        for _ in range(3):
            engine.backward(engine(steps()).sum())
            engine.step()
            frames.append(counters["frames"]["total"])
        assert frames[0] > 0 and frames[1:] == [frames[0]] * 2, frames
