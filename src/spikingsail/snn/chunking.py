"""Time-chunked gradient checkpointing for multi-step spiking networks (config ``snn.time_chunk``).

Backpropagation through time keeps every time step's activations, so one training step's memory
grows linearly with T. With ``snn.time_chunk: k`` a training forward runs the ``[T, N, ...]``
input in chunks of at most k steps under non-reentrant gradient checkpointing: each chunk keeps
only its input and the neuron state it starts from; backward recomputes one chunk at a time, so
the activations alive at once are one chunk's, plus a boundary state per chunk. The last chunk,
whose backward comes first, keeps its activations and is not recomputed.

Each chunk runs under torch's non-reentrant checkpoint as an explicit-state forward (what
spikingjelly's ``base.to_functional_forward`` does, with the model's memory slots listed once instead
of walked four times per chunk), so every ``MemoryModule``'s state is carried from chunk to chunk as
the chunk's input and output, and the RNG state is replayed when a chunk is recomputed (dropout masks
are the same). Batch norms commit their running statistics once per chunk: in the recompute they
normalise with the chunk's batch statistics as before but do not update them again (a training batch
norm's output never reads its running statistics; an eval-mode one only reads them). A model with
other buffers goes through spikingjelly's ``activation_based.memopt`` path instead, which hands every
chunk a copy of all buffers taken before it: correct for any buffer, at the cost of a copy of every
buffer per chunk (BNTT keeps T norms per layer, so that is T²/k of them). The model is wrapped in
torch's ``CheckpointWrapper``, which keeps parameter objects and ``state_dict`` keys, so checkpoints
load with and without chunks.

Gradients equal the unchunked run's up to float rounding (a weight's gradient is summed over the
chunks instead of in one reduction), for a model that is local in time. The first chunked forward
checks that it is (``chunk_check``): a module that mixes time steps, a buffer changed on every call
or a model whose input has no time axis is refused, naming it, before the first step. Batch norm that uses batch statistics normalises over all
T × N samples of a call; chunks would normalise over k × N and train a different model, so the
engine refuses it unless ``snn.chunk_batchnorm`` is ``"per_chunk"``. Batch norm through time
(``layer.BatchNormThroughTime*``, one norm per step) and frozen (eval-mode) batch norm chunk exactly.

``time_chunk: "auto"`` measures, at the first training forward of each input shape, the bytes one
time step keeps for backward and the bytes of neuron state a chunk boundary keeps, and picks the
largest chunk whose estimate fits ``snn.memory_budget_mb``; it logs what it chose.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from spikingsail.config.schema import SNNConfig
from spikingsail.errors import ConfigError, SailError
from spikingsail.snn.chunk_check import check_chunks, eagerly

log = logging.getLogger(__name__)

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class ChunkChoice:
    """What ``time_chunk: "auto"`` picked for one input shape."""

    time_steps: int
    steps_per_chunk: int
    chunks: int
    bytes_per_step: int
    bytes_per_boundary: int
    estimate_bytes: int
    fits: bool

    def describe(self, budget_mb: float) -> str:
        per_step, boundary = self.bytes_per_step / MIB, self.bytes_per_boundary / MIB
        head = (
            f"snn.time_chunk auto: T={self.time_steps} in {self.chunks} chunk(s) of ≤{self.steps_per_chunk} "
            f"step(s); estimated {self.estimate_bytes / MIB:.1f} MiB of activations "
            f"({per_step:.2f} MiB per step, {boundary:.2f} MiB of state per chunk boundary)"
        )
        if self.fits:
            return f"{head} within the {budget_mb:g} MiB budget"
        return f"{head}: over the {budget_mb:g} MiB budget, which no chunk size meets; this is the smallest estimate"


class TimeChunking:
    """The checkpoint function of the ``CheckpointWrapper`` that :func:`time_chunked` returns."""

    def __init__(self, config: SNNConfig, model: nn.Module, source: str) -> None:
        from spikingjelly.activation_based import base
        from spikingjelly.activation_based.memopt import checkpointing

        self.config = config
        self.source = source
        self._base = base
        self._all_buffers_forward = checkpointing._checkpoint_module_forward
        self._merge = checkpointing._merge_chunk_outputs
        # Every chunk runs through the model's __call__, not spikingjelly's per-layer composition:
        # FSDP2 and ZeRO-3 gather parameters in forward hooks, which a bypassed __call__ would skip.
        # What a chunk touches is listed once: a model's modules do not change while it trains, and
        # walking them per chunk costs more than a chunk's kernels on a GPU (BNTT keeps T norms a layer).
        self._model = model
        self._slots = _memory_slots(model, base.MemoryModule)
        self._functional = base.to_functional_forward(model, fn=model.__call__)  # for the other-buffers path
        self._batch_norms = _batch_norms_over_time(model)
        self._norms = [m for m in model.modules() if isinstance(m, _BatchNorm)]
        self._other_buffers = bool(_other_buffers(model))
        self.choices: dict[tuple[Any, ...], ChunkChoice] = {}
        self._checked = False

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not (torch.is_grad_enabled() and module.training):
            return module(*args, **kwargs)  # no backward follows: nothing to keep, nothing to chunk
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise SailError(
                "snn.time_chunk: the model's first argument is "
                + (f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"{type(x).__name__}"),
                "time chunks split the first argument, a [T, N, ...] sequence, along its first dimension",
                "call the engine with the [T, N, ...] input first (engine.encode(x) makes one), or drop snn.time_chunk",
            )  # fmt: skip
        self._check_batch_norm()
        time_steps = x.shape[0]
        steps = self._steps_per_chunk(module, x, args[1:], kwargs)
        chunks = math.ceil(time_steps / steps)
        if chunks <= 1:
            return module(*args, **kwargs)
        if torch.compiler.is_compiling() or not self._checked:  # traced, the flag is read eagerly
            self._check_once(x, args[1:], kwargs, chunks)
        if self._other_buffers:
            return self._all_buffers_forward(
                module, *args, functional_forward=self._functional, compressor=None, chunks=chunks,
                chunked_args=(0,), time_dim=0, **kwargs,
            )  # fmt: skip
        return self._forward_chunks(module, x, args[1:], kwargs, chunks)

    @eagerly
    def _check_once(
        self, x: torch.Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any], chunks: int
    ) -> None:
        """Before the first chunked forward: exact or refused (chunk_check.py). Under torch.compile
        the flag is read here, outside the compiled forward, which would guard on it and compile the
        model again once it is set; an eager forward reads it itself and calls nothing once it is."""
        if not self._checked:
            setting = f"{self.source}: snn.time_chunk is {self.config.time_chunk!r}"
            check_chunks(self._model, x, rest, kwargs, chunks, self._slots, setting)
            self._checked = True

    def _forward_chunks(
        self, module: nn.Module, x: torch.Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any], chunks: int
    ) -> Any:
        """The chunks one after another, the neuron state passed from one to the next.

        Every chunk but the last is checkpointed. The last one's backward comes first, right after
        the forward, so its activations are kept instead of recomputed (as ``checkpoint_sequential``
        does with its last segment): the peak is the same, a chunk's activations and the boundaries
        before it, and the step recomputes one chunk fewer.
        """
        states = self._extract()
        count = 1 + len(rest)
        pieces = torch.tensor_split(x, chunks, dim=0)
        outputs = []
        for piece in pieces[:-1]:
            output, states = checkpoint(
                self._run_chunk, count, piece, *rest, *states, use_reentrant=False,
                context_fn=functools.partial(_contexts, self._norms), **kwargs,
            )  # fmt: skip
            outputs.append(output)
        output, states = self._run_chunk(count, pieces[-1], *rest, *states, **kwargs)
        outputs.append(output)
        self._load(states)
        return self._merge(outputs, 0)

    def _run_chunk(self, count: int, *flat: Any, **kwargs: Any) -> tuple[Any, tuple[Any, ...]]:
        """The model on one chunk's inputs from the given neuron state: its output and the state after.

        The model's own state is left as it was (the recompute in backward runs this again).
        """
        original = self._extract()
        self._load(flat[count:])
        try:
            result = self._model(*flat[:count], **kwargs)
            states = self._extract()
        finally:
            self._load(original)
        outputs = tuple(result) if isinstance(result, (tuple, list)) else (result,)
        return (outputs[0] if len(outputs) == 1 else outputs), states

    def _extract(self) -> tuple[Any, ...]:
        return tuple(memory._memories[name] for memory, name in self._slots)

    def _load(self, states: tuple[Any, ...]) -> None:
        if len(states) != len(self._slots):
            raise SailError(
                f"{self.source}: snn.time_chunk: the model has {len(self._slots)} neuron state slots, "
                f"a chunk was handed {len(states)}",
                "memory modules were added to or removed from the model after the engine wrapped it",
                "build the whole model before calling spikingsail (or SpikingSail(...).run())",
            )
        for (memory, name), value in zip(self._slots, states, strict=True):
            memory._memories[name] = value

    def _check_batch_norm(self) -> None:
        if self.config.chunk_batchnorm == "per_chunk":
            return
        live = [name for name, bn in self._batch_norms if bn.training or not bn.track_running_stats]
        if live:
            more = f" (and {len(live) - 1} more)" if len(live) > 1 else ""
            raise ConfigError(
                f"{self.source}: snn.time_chunk is {self.config.time_chunk!r}, and batch norm "
                f"'{live[0]}'{more} normalises with batch statistics",
                "in multi-step mode a batch norm's statistics span all T × N samples of a call; time chunks "
                "would compute them over each chunk's k × N samples and train a different model",
                "use batch norm through time (spikingjelly layer.BatchNormThroughTime2d: one norm per step), "
                'freeze the batch norms (eval mode), set snn.chunk_batchnorm to "per_chunk" to accept '
                "per-chunk statistics, or drop snn.time_chunk",
            )

    def _steps_per_chunk(
        self, module: nn.Module, x: torch.Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> int:
        if self.config.time_chunk != "auto":
            return int(self.config.time_chunk)
        key = (tuple(x.shape), x.dtype, torch.is_autocast_enabled(x.device.type))
        choice = self.choices.get(key)
        if choice is None:
            per_step, boundary = self._measure(module, x, rest, kwargs)
            budget = float(self.config.memory_budget_mb or 0) * MIB
            choice = choose_chunk(x.shape[0], per_step, boundary, budget)
            self.choices[key] = choice
            (log.info if choice.fits else log.warning)(
                choice.describe(float(self.config.memory_budget_mb or 0))
            )
        return choice.steps_per_chunk

    @eagerly  # once per input shape: it counts what the model's eager forward saves
    def _measure(
        self, module: nn.Module, x: torch.Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[int, int]:
        """Bytes kept for backward per time step, and bytes of neuron state at a chunk boundary.

        Runs the model on the first one and two time steps with a counter on the tensors autograd
        saves; the difference is one step's share. Neuron state, buffers and the RNG are put back.
        """
        base = self._base
        states = base.extract_memories(module)
        buffers = [(b, b.detach().clone()) for b in module.buffers()]
        rng = torch.random.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else None
        parameters = {p.data_ptr() for p in module.parameters()}
        kept: list[int] = []
        boundary = 0
        try:
            for steps in (1, 2):
                base.load_memories(module, list(states))
                counter = _SavedBytes(parameters)
                with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                    out = module(x[:steps], *rest, **kwargs)
                del out
                kept.append(counter.total)
                if steps == 1:
                    boundary = sum(
                        t.numel() * t.element_size()
                        for t in base.extract_memories(module)
                        if isinstance(t, torch.Tensor)
                    )
        finally:
            base.load_memories(module, list(states))
            with torch.no_grad():
                for live, saved in buffers:
                    live.copy_(saved)
            torch.random.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, x.device)
        return max(kept[1] - kept[0], 1), boundary


def choose_chunk(
    time_steps: int, bytes_per_step: int, bytes_per_boundary: int, budget_bytes: float
) -> ChunkChoice:
    """The largest chunk (fewest recomputed kernels) whose estimate fits the budget, else the smallest estimate.

    A chunk of k steps keeps k steps' activations while it is recomputed, and every chunk after the
    first keeps the neuron state it starts from: ``k × per_step + (ceil(T / k) − 1) × per_boundary``.
    """

    def estimate(k: int) -> int:
        return k * bytes_per_step + (math.ceil(time_steps / k) - 1) * bytes_per_boundary

    sizes = range(1, time_steps + 1)
    fitting = [k for k in sizes if estimate(k) <= budget_bytes]
    k = max(fitting) if fitting else min(sizes, key=lambda s: (estimate(s), -s))
    return ChunkChoice(
        time_steps,
        k,
        math.ceil(time_steps / k),
        bytes_per_step,
        bytes_per_boundary,
        estimate(k),
        bool(fitting),
    )


class _SavedBytes:
    """A saved-tensor hook pair that adds up the bytes of what autograd keeps (parameters aside)."""

    def __init__(self, parameters: set[int]) -> None:
        self.total = 0
        self._seen = set(parameters)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in self._seen:
            self._seen.add(pointer)
            self.total += tensor.untyped_storage().nbytes()
        return tensor

    def unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _other_buffers(model: nn.Module) -> list[str]:
    """Buffers that are not a batch norm's: a chunk's recompute could read them changed, or change them again."""
    norms = {id(b) for m in model.modules() if isinstance(m, _BatchNorm) for b in m.buffers(recurse=False)}
    return [name for name, b in model.named_buffers() if id(b) not in norms]


def _memory_slots(module: nn.Module, memory_module: type[nn.Module]) -> list[tuple[Any, str]]:
    """Every (``MemoryModule``, memory name) in the order of spikingjelly's ``extract_memories``."""
    memories: dict[str, Any] = module.__dict__.get("_memories", {})
    slots: list[tuple[Any, str]] = (
        [(module, name) for name in memories] if isinstance(module, memory_module) else []
    )
    for _, child in module.named_children():
        slots += _memory_slots(child, memory_module)
    return slots


def _contexts(
    norms: list[_BatchNorm],
) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """``checkpoint``'s ``context_fn``: nothing in the forward, running statistics left alone in the recompute."""
    return contextlib.nullcontext(), _statistics_kept(norms)


@contextlib.contextmanager
def _statistics_kept(norms: list[_BatchNorm]) -> Iterator[None]:
    """Training batch norms normalise with batch statistics but leave their running ones unchanged.

    The forward already updated them once for this chunk. With a momentum of 0 the update is
    ``running × 1 + batch × 0``, the running value itself, and ``num_batches_tracked`` counts into a
    scratch tensor. The output is the forward's: a training batch norm never reads its running
    statistics, and it saves the same tensors for backward (which a recompute must).
    """
    # Through each module's __dict__ and _buffers, not nn.Module's attribute protocol: BNTT models
    # have hundreds of norms, and this runs for every recomputed chunk.
    kept = [
        (m.__dict__, m._buffers, m.__dict__["momentum"], m._buffers.get("num_batches_tracked"))
        for m in norms
        if m.training and m.track_running_stats
    ]
    scratch: dict[torch.device, torch.Tensor] = {}
    for attributes, buffers, _, counter in kept:
        attributes["momentum"] = 0.0
        if counter is not None:
            if counter.device not in scratch:
                scratch[counter.device] = torch.zeros_like(counter)
            buffers["num_batches_tracked"] = scratch[counter.device]
    try:
        yield
    finally:
        for attributes, buffers, momentum, counter in kept:
            attributes["momentum"] = momentum
            if counter is not None:
                buffers["num_batches_tracked"] = counter


def _batch_norms_over_time(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Batch norms whose batch statistics span the time steps of a call (not one norm per step)."""
    from spikingjelly.activation_based.layer.bn import _BatchNormThroughTimeBase  # one norm per step

    per_step = {id(m) for module in model.modules() if isinstance(module, _BatchNormThroughTimeBase)
                for m in module.modules()}  # fmt: skip
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and id(m) not in per_step
    ]


def time_chunked(
    model: nn.Module, config: SNNConfig, adapter_name: str | None, multi_step: bool, source: str
) -> nn.Module:
    """``model`` wrapped so that a training forward runs in time chunks (``snn.time_chunk``)."""
    if adapter_name != "spikingjelly":
        raise ConfigError(
            f"{source}: snn.time_chunk is {config.time_chunk!r}, but "
            + (
                "the model has no spiking neurons"
                if adapter_name is None
                else f"its neurons are {adapter_name}'s"
            ),
            "time chunks carry spikingjelly neurons' state (activation_based MemoryModule) from chunk to chunk",
            "build the model from spikingjelly neurons, or drop snn.time_chunk",
        )
    if not multi_step:
        raise ConfigError(
            f"{source}: snn.time_chunk is {config.time_chunk!r}, but the model's neurons are not all in multi-step mode",
            "time chunks split the [T, N, ...] sequence of one multi-step call",
            'set "snn": {"step_mode": "m"} (or functional.set_step_mode(model, "m")), or drop snn.time_chunk',
        )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(model, checkpoint_fn=TimeChunking(config, model, source))
