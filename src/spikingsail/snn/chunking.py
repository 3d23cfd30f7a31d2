"""Time-chunked gradient checkpointing for multi-step spiking networks (config ``snn.time_chunk``).

Backpropagation through time keeps every time step's activations, so one training step's memory
grows linearly with T. With ``snn.time_chunk: k`` a training forward runs the ``[T, N, ...]``
input in chunks of at most k steps under non-reentrant gradient checkpointing: each chunk keeps
only its input and the neuron state it starts from; backward recomputes one chunk at a time, so
the activations alive at once are one chunk's, plus a boundary state per chunk.

The machinery is spikingjelly's own (``activation_based.memopt``): its checkpointed forward carries
every ``MemoryModule``'s state explicitly from chunk to chunk, replays the RNG state when it
recomputes (dropout masks are the same), and commits buffers such as batch-norm running statistics
once per chunk, not again in the recompute. The model is wrapped in torch's ``CheckpointWrapper``,
which keeps parameter objects and ``state_dict`` keys, so checkpoints load with and without chunks.

Gradients equal the unchunked run's up to float rounding (a weight's gradient is summed over the
chunks instead of in one reduction). Batch norm that uses batch statistics normalises over all
T × N samples of a call; chunks would normalise over k × N and train a different model, so the
engine refuses it unless ``snn.chunk_batchnorm`` is ``"per_chunk"``. Batch norm through time
(``layer.BatchNormThroughTime*``, one norm per step) and frozen (eval-mode) batch norm chunk exactly.

``time_chunk: "auto"`` measures, at the first training forward of each input shape, the bytes one
time step keeps for backward and the bytes of neuron state a chunk boundary keeps, and picks the
largest chunk whose estimate fits ``snn.memory_budget_mb``; it logs what it chose.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from spikingsail.config.schema import SNNConfig
from spikingsail.errors import ConfigError, SailError

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
        self._forward_chunks = checkpointing._checkpoint_module_forward
        # Through the model's __call__, not spikingjelly's per-layer composition: FSDP2 and ZeRO-3
        # gather parameters in forward hooks, which a bypassed __call__ would skip.
        self._functional = base.to_functional_forward(model, fn=model.__call__)
        self._batch_norms = _batch_norms_over_time(model)
        self.choices: dict[tuple[Any, ...], ChunkChoice] = {}

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
        return self._forward_chunks(
            module, *args, functional_forward=self._functional, compressor=None, chunks=chunks,
            chunked_args=(0,), time_dim=0, **kwargs,
        )  # fmt: skip

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
