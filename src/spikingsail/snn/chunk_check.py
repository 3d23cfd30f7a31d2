"""The check that time chunks compute what the whole forward computes, run once before they train.

Time chunks run a multi-step model on k of its T steps at a time and carry only the neurons' state
(spikingjelly memories) from one chunk to the next. That is exact for a model whose every part is
local in time; a part that reads other time steps (a mean, attention or a convolution over T), a
buffer that changes on every call, or a model whose first argument is not its time axis (the
tutorials' ``forward(x)`` that repeats an ``[N, ...]`` image over T inside) computes something else
in chunks, silently. No structural rule sees a ``x.mean(0)`` in a ``forward``, so the first chunked
training forward runs the model twice without gradients on the steps of its first two chunks: whole,
and in those two chunks, and compares every module's inputs and outputs along the way.

Both runs start from the same neuron state, buffers and RNG state, with torch's batch norms and
dropouts in eval mode (the comparison is then deterministic and no running statistic moves),
autocast and TF32 off (float32 rounding, not bf16's, between the two) and the neurons firing
smoothly (``_smooth``); everything is put back afterwards. Under ``torch.compile`` the check runs
eagerly (``eagerly``): it is a property of the model, taken once, and tracing its hooks and two
forwards, or compiling the compiled modules again for its no-grad shapes, costs more than the
training step's own compilation (minutes on a CPU).
Each module call keeps a fingerprint per index of each dimension (three sums, in float64), not its
output, so the check holds what a no-grad forward of 2k steps holds: less than the training forward's
chunks keep, for a model of more than a few layers.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd
from torch.utils._pytree import tree_leaves

from spikingsail.errors import ConfigError
from spikingsail.snn.float32 import float32_exact

Slots = list[tuple[Any, str]]  # (MemoryModule, memory name), as TimeChunking lists them
Site = tuple[str, str]  # (the module's name, the name of the module whose forward called it)
Calls = dict[Site, list["_Call"]]  # in the order the sites first return


@dataclass(frozen=True, slots=True)
class _Seen:
    """A tensor as the check keeps it: its shape and, per dimension, one fingerprint row per index."""

    shape: tuple[int, ...]
    rtol: float
    rows: tuple[torch.Tensor, ...]


@dataclass(slots=True)
class _Call:
    inputs: list[_Seen]
    outputs: list[_Seen]
    steps: int | None  # the leading size of a multi-step memory module's input: its time steps


class _Recorder:
    """Forward hooks on every module that keep a fingerprint of each call's inputs and outputs."""

    def __init__(self, model: nn.Module, stepping: set[int]) -> None:
        self.names = {id(m): name for name, m in model.named_modules()}
        self.stepping = stepping
        self.calls: Calls = {}  # in the order the modules first return
        self._running: list[str] = []  # the modules whose forward is running, outermost first
        self._weights: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        self._handles = [m.register_forward_pre_hook(self._enter) for m in model.modules()]
        self._handles += [m.register_forward_hook(self._hook, with_kwargs=True) for m in model.modules()]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._running.append(self.names[id(module)])

    def _hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        # Calls are told apart by where they come from: one module may serve many (spikingjelly's
        # default surrogate function is one object in every neuron), each in its own order.
        name = self._running.pop()
        site = (name, self._running[-1] if self._running else "")
        first = args[0] if args else None
        stepping = id(module) in self.stepping and isinstance(first, torch.Tensor) and first.dim() > 0
        steps = int(first.shape[0]) if stepping and first is not None else None
        call = _Call(self._seen((args, kwargs)), self._seen(output), steps)
        self.calls.setdefault(site, []).append(call)

    def _seen(self, tree: Any) -> list[_Seen]:
        return [
            self._fingerprint(t)
            for t in tree_leaves(tree)
            if isinstance(t, torch.Tensor) and not t.is_complex()
        ]

    def _fingerprint(self, tensor: torch.Tensor) -> _Seen:
        t = tensor.detach()
        rtol = max(1e-5, 2 * torch.finfo(t.dtype).eps) if t.is_floating_point() else 0.0
        t = t if t.is_floating_point() else t.double()  # masks and counters: small
        t = t.reshape(1) if t.dim() == 0 else t
        rows = []
        for d in range(t.dim()):  # in the tensor's own dtype, summed in float64: no float64 copy of it
            flat = t.movedim(d, 0).reshape(t.shape[d], t.numel() // t.shape[d] if t.shape[d] else 0)
            sums = flat.sum(1, dtype=torch.float64)
            magnitudes = torch.linalg.vector_norm(flat, 1, dim=1, dtype=torch.float64)
            rows.append(torch.stack([sums, magnitudes, (flat @ self._weight(flat)).double()], 1))
        return _Seen(tuple(tensor.shape), rtol, tuple(rows))

    def _weight(self, flat: torch.Tensor) -> torch.Tensor:
        """A fixed, irregular weight per position: a sum that also sees values moved within a row."""
        key = (flat.shape[1], flat.dtype, flat.device)
        if key not in self._weights:
            positions = torch.arange(flat.shape[1], dtype=torch.float64, device=flat.device)
            self._weights[key] = torch.cos(positions * 0.618034 + 0.5).to(flat.dtype)
        return self._weights[key]


P = ParamSpec("P")
R = TypeVar("R")


def eagerly(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` outside ``torch.compile``: not traced where a compiled forward calls it, and the compiled
    modules it calls run as written (their graphs are the training step's, not a check's)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with torch.compiler.set_stance("force_eager"):
            return fn(*args, **kwargs)

    disabled: Callable[P, R] = torch.compiler.disable(run)  # type: ignore[no-untyped-call]
    return disabled


@eagerly
def check_chunks(model: nn.Module, x: torch.Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any],
                 chunks: int, slots: Slots, what: str) -> None:  # fmt: skip
    """Raise ``ConfigError`` unless ``chunks`` chunks of ``x`` give what the whole ``x`` gives.

    ``what`` opens every message (the config's source and the ``snn.time_chunk`` setting). The
    neurons fire smoothly if the model runs that way (see ``_smooth``), else as they train.
    """
    from spikingjelly.activation_based import base, surrogate

    stepping = {id(m) for m in model.modules()
                if isinstance(m, base.MemoryModule) and getattr(m, "step_mode", None) == "m"}  # fmt: skip
    spiking: list[Any] = [
        m for m in model.modules() if isinstance(m, surrogate.SurrogateFunctionBase) and m.spiking
    ]
    # The first two chunks the training forward will use, and their steps whole: one chunk boundary,
    # and a no-grad forward of 2k steps, not T (which could hold more than the chunks save).
    pieces = torch.tensor_split(x, chunks, dim=0)[:2]
    for smooth in [True, False] if spiking else [False]:
        try:
            with _smooth(spiking if smooth else []):
                _compare(model, stepping, slots, (x, rest, kwargs), pieces, what)
            return
        except _WholeRunError as failed:  # e.g. a kernel that only fires spikes: check them as they are
            if smooth:
                continue
            if _runs(model, slots, (x, rest, kwargs)):  # on all T steps but not on 2k
                raise _fails(what, x, len(failed.steps), failed.error) from failed.error
            raise failed.error from None  # as the model's own forward would have failed


def _runs(model: nn.Module, slots: Slots, call: tuple[Any, ...]) -> bool:
    x, rest, kwargs = call
    with _restored(model, slots, x.device), torch.no_grad(), float32_exact(_device_type(model)):
        try:
            model(x, *rest, **kwargs)
        except Exception:
            return False
    return True


class _WholeRunError(Exception):
    def __init__(self, steps: torch.Tensor, error: Exception) -> None:
        super().__init__(str(error))
        self.steps, self.error = steps, error


def _fails(what: str, x: torch.Tensor, steps: int, error: Exception) -> ConfigError:
    return ConfigError(
        f"{what}: the model fails when called on {steps} of the {x.shape[0]} time steps of its input "
        f"{tuple(x.shape)} ({type(error).__name__}: {error})",
        "time chunks call the model on k steps at a time, which this model does not accept",
        "give the model a [T, N, ...] sequence that it steps through (any T), or drop snn.time_chunk",
    )


def _compare(model: nn.Module, stepping: set[int], slots: Slots, call: tuple[Any, ...],
             pieces: tuple[torch.Tensor, ...], what: str) -> None:  # fmt: skip
    x, rest, kwargs = call
    steps = x[: sum(len(p) for p in pieces)]
    with _restored(model, slots, x.device) as restart:
        whole: list[Calls] = []
        try:
            _record(model, stepping, whole, lambda: model(steps, *rest, **kwargs))
        except Exception as error:
            raise _WholeRunError(steps, error) from error
        _check_time_axis(whole, [len(steps)], x, what)
        whole_buffers = _other_buffers(model)
        restart()
        parts: list[Calls] = []
        try:
            _record(model, stepping, parts, lambda: [model(piece, *rest, **kwargs) for piece in pieces])
        except Exception as error:  # the model cannot run on a chunk: say why instead of its traceback
            _check_time_axis(parts, [len(p) for p in pieces[: len(parts)]], x, what)
            raise _fails(what, x, len(pieces[len(parts)]), error) from error
        _check_time_axis(parts, [len(p) for p in pieces], x, what)
        _check_buffers(whole_buffers, _other_buffers(model), what)
        _check_modules(model, whole, parts, [len(p) for p in pieces], what)


@contextlib.contextmanager
def _smooth(surrogates: list[Any]) -> Iterator[None]:
    """Neurons that fire smoothly: their surrogate function's primitive instead of a step.

    (spikingjelly's non-spiking mode: the function whose derivative the surrogate gradient is.)
    The model stays local in time or not, as it is; but a part that mixes time steps shows even where
    no neuron spikes yet on this micro-batch (a mean over all-zero spikes is the same in chunks, its
    gradient is not), and the last bit of a convolution's rounding cannot flip a spike and make a
    local model look different in chunks.
    """
    for m in surrogates:
        m.spiking = False
    try:
        yield
    finally:
        for m in surrogates:
            m.spiking = True


def _record(model: nn.Module, stepping: set[int], runs: list[Calls], run: Any) -> None:
    """Appends to ``runs`` the calls of each module in every run of the model that ``run`` makes."""
    recorder = _Recorder(model, stepping)

    def split(module: nn.Module, args: Any, output: Any) -> None:  # a run of the model ends here
        runs.append(recorder.calls)
        recorder.calls = {}

    handle = model.register_forward_hook(split)  # after the recorder's own hook on the model
    try:
        with torch.no_grad(), float32_exact(_device_type(model)):
            run()
    finally:
        handle.remove()
        recorder.close()


def _device_type(model: nn.Module) -> str:
    parameter = next(model.parameters(), None)
    return parameter.device.type if parameter is not None else "cpu"


def _check_time_axis(runs: list[Calls], lengths: list[int], x: torch.Tensor, what: str) -> None:
    """Every multi-step memory module (neurons, BNTT) steps through the time steps the call was given."""
    for calls, length in zip(runs, lengths, strict=True):
        for (name, _), module_calls in calls.items():
            steps = next((c.steps for c in module_calls if c.steps is not None and c.steps != length), None)
            if steps is not None:
                raise ConfigError(
                    f"{what}: the model's first argument is not its time axis: called on {length} of the "
                    f"{x.shape[0]} entries of the first dimension of its input {tuple(x.shape)}, its multi-step "
                    f"module '{name}' stepped through {steps} step(s)",
                    "time chunks split the first dimension of the model's input as T; a model whose forward "
                    "takes [N, ...] and repeats it over T inside (spikingjelly's tutorial models) would be "
                    "split along the batch, and its neurons carry one sample's state into another",
                    "move the repeat over T out of the model: call it with the [T, N, ...] sequence "
                    "(engine.encode(x) makes one from snn.time_steps and snn.encoding) and average its output "
                    "over T outside (spikingsail.snn.firing_rate), or drop snn.time_chunk",
                )


def _check_modules(
    model: nn.Module, whole: list[Calls], parts: list[Calls], lengths: list[int], what: str
) -> None:  # fmt: skip
    """The first module, in the order they return, whose chunked outputs are not its whole ones."""
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    (calls,) = whole
    for site, module_calls in calls.items():
        chunk_calls = [part.get(site, []) for part in parts]
        if _calls_match(module_calls, chunk_calls, outputs=True):
            continue
        name, caller = site
        chunked = f"on the first micro-batch's first {' + '.join(map(str, lengths))} steps in chunks"
        if _calls_match(module_calls, chunk_calls, outputs=False):
            module = (
                f"module '{name}' ({kinds[name]})" if name else f"the model's own forward ({kinds[name]})"
            )
            culprit = f"{module} mixes time steps: its output {chunked} differs from its output on them whole"
        else:  # its input differs although every module that returned before it matched
            where = (
                f"the forward of '{caller}' ({kinds[caller]})"
                if caller
                else f"the model's own forward ({kinds['']})"
            )
            culprit = (
                f"{where} mixes time steps between the modules it calls: the input of '{name}' {chunked} "
                "differs from its input on them whole"
            )
        raise ConfigError(
            f"{what}: {culprit}",
            "time chunks run the model on a few steps at a time and carry only the neurons' state from one "
            "chunk to the next; a part that reads other time steps (a mean, attention or a convolution over "
            "T) sees only its own chunk, and training would silently differ from the model without chunks",
            "apply the time mixing outside the engine's forward (to the model's [T, N, ...] output), "
            "keep what it needs from earlier steps as spikingjelly memory (register_memory) so chunks "
            "carry it, or drop snn.time_chunk",
        )


def _calls_match(whole: list[_Call], chunked: list[list[_Call]], outputs: bool) -> bool:
    """Whether the calls in chunks put together are the whole run's calls.

    A module called once per step (the norms inside batch norm through time) makes its calls spread
    over the chunks: then they match the whole run's one for one. A module called once per run
    makes one call per chunk: then the chunks' calls are joined along the one dimension whose size
    the chunks split (time, or time × batch flattened time-major).
    """

    def side(call: _Call) -> list[_Seen]:
        return call.outputs if outputs else call.inputs

    spread = [call for chunk in chunked for call in chunk]
    if len(spread) == len(whole) and all(
        _leaves_match(side(w), [side(c)]) for w, c in zip(whole, spread, strict=True)
    ):
        return True
    if any(len(chunk) != len(whole) for chunk in chunked):
        return False
    return all(_leaves_match(side(w), [side(chunk[j]) for chunk in chunked]) for j, w in enumerate(whole))


def _leaves_match(whole: list[_Seen], parts: list[list[_Seen]]) -> bool:
    if any(len(p) != len(whole) for p in parts):
        return False
    return all(_joined(w, [p[i] for p in parts]) for i, w in enumerate(whole))


def _joined(whole: _Seen, parts: list[_Seen]) -> bool:
    if all(p.shape == whole.shape for p in parts):  # no time dimension: every chunk must give the same
        return all(_close(p.rows[0], whole.rows[0], whole.rtol) for p in parts)
    if any(len(p.shape) != len(whole.shape) for p in parts):
        return False
    split = [d for d, size in enumerate(whole.shape) if any(p.shape[d] != size for p in parts)]
    if len(split) != 1 or sum(p.shape[split[0]] for p in parts) != whole.shape[split[0]]:
        return False
    joined = torch.cat([p.rows[split[0]] for p in parts])
    return _close(joined, whole.rows[split[0]], whole.rtol)


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> bool:
    """Equal up to the tensor's rounding: each element off by rtol moves a sum by rtol × its sum of |x|."""
    scale = torch.maximum(got[:, 1:2], want[:, 1:2])
    return bool(((got - want).abs() <= rtol * scale + 1e-6).all())


def _other_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    norms = {id(b) for m in model.modules() if isinstance(m, _BatchNorm) for b in m.buffers(recurse=False)}
    return {name: b.detach().clone() for name, b in model.named_buffers() if id(b) not in norms}


def _check_buffers(whole: dict[str, torch.Tensor], chunked: dict[str, torch.Tensor], what: str) -> None:
    for name, value in whole.items():
        got = chunked[name]
        same = got.shape == value.shape and (
            torch.allclose(got.double(), value.double(), rtol=1e-5, atol=1e-6)
            if value.is_floating_point()
            else torch.equal(got, value)
        )
        if not same:
            raise ConfigError(
                f"{what}: buffer '{name}' ends the first micro-batch's forward with another value in chunks "
                "than on the whole sequence",
                "the model changes it on every call, and time chunks call the model once per chunk: "
                "training would silently differ from the model without chunks",
                "change the buffer once per sequence (e.g. outside the model's forward), or drop snn.time_chunk",
            )


@contextlib.contextmanager
def _restored(model: nn.Module, slots: Slots, device: torch.device) -> Iterator[Any]:
    """Neuron state, buffers, RNG and train/eval modes as they were, for each run and afterwards.

    Yields a function that puts them back between the runs.
    """
    memories = tuple(memory._memories[name] for memory, name in slots)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    frozen = [m for m in model.modules() if isinstance(m, (_BatchNorm, _DropoutNd)) and m.training]

    def restart() -> None:
        for (memory, name), value in zip(slots, memories, strict=True):
            memory._memories[name] = value
        with torch.no_grad():
            for live, saved in buffers:
                live.copy_(saved)
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)

    for m in frozen:
        m.training = False
    try:
        yield restart
    finally:
        restart()
        for m in frozen:
            m.training = True
