"""The matrix's cells, what each one guarantees, and the tolerance of each row (with the reason)."""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import asdict, dataclass
from typing import Any

BACKENDS = {  # name in the matrix -> (sail.backend, zero_optimization.stage)
    "ddp": ("ddp", 0),
    "ddp+zero1": ("ddp", 1),
    "fsdp": ("fsdp", 3),
    "deepspeed-zero2": ("deepspeed", 2),
    "horovod": ("horovod", 0),
}
PRECISIONS = ("fp32", "bf16")
ACCUMULATIONS = (1, 3)
SCHEDULERS = ("client", "config")
INTERRUPTIONS = ("none", "boundary", "window", "world", "sigkill")
TOPOLOGIES = ("ranks", "replicas")
"""2 gloo ranks of one job, or 2 replica groups of 1 process (``sail launch --ft-replicas 2 -n 1``:
torchft's quorum, the cross-group all-reduce and vote, per-group checkpoints)."""
BALANCES = ("off", "3:1")
"""sail.balance: equal micro-batches, or rank 0 taking three quarters of every global micro-batch
(a resume takes the other split, 1:3, or none on one process)."""
MODELS = ("mlp", "snn", "bn", "tied")
"""The matrix job's MLP; the same layers with batch norm after the hidden layer, synchronised across
ranks (``snn.sync_batchnorm``: statistics over each global micro-batch, which the one-process reference
takes as one micro-batch of the same samples; its running statistics are compared too); the MLP with
two more hidden layers that share one weight (tied weights, as an embedding and an output layer share
theirs); or the same layers as a spiking network: a LIF neuron (spikingjelly, surrogate gradient)
after the hidden layer, multi-step over ``SNN_TIME_STEPS`` steps of the repeated input,
trained with ``snn.time_chunk: 2`` (each forward checkpointed in chunks of 2 steps and recomputed chunk
by chunk in backward; the neuron state reset before every forward). Spiking cells are fp32 only: a
bf16 rounding that moves a membrane potential across the threshold flips a spike, which no elementwise
tolerance bounds (DeepSpeed's bf16 model, with bf16 weights and potentials, flipped one within 6 steps
and moved one weight by 0.007, 29% of it); tests/snn/test_chunking.py compares a bf16 spiking run
(ddp, chunked against whole) on its own."""
INITS = ("seeded", "per-rank")
"""Every process builds the model from the same seed, or from its own (the global rank: a script that
seeds nothing before building its model): the job must start from rank 0's weights everywhere."""
EPOCHS = ("whole", "ragged")
"""The job's dataset: 96 samples, whole steps; or ``RAGGED_LENGTH`` samples, every epoch ending with a
short step, which every split must take as the same samples with the same weights (accumulation 1:
four steps of 8 and one of 4 per epoch; accumulation 3: one step of 24 and one of 12, in 3
micro-batches of 4). The resumes after step 3 come before a short step, and the save inside a window
(accumulation 3) falls inside one. Each short micro-batch has 2 samples per rank: synchronised batch
statistics over 1 sample per rank are so ill-conditioned that the last bits of their sums moved a
weight by 2e-6, more than the fp32 tolerance."""
COMPILES = ("eager", "inductor")
"""The model as it is, or compiled (``"compile": {"enabled": true}``: torch.compile with inductor, whose
C++ backend runs on the CPU), the reference compiled too: a compiled engine trains like the compiled
plain loop. A sample holds ``COMPILED_CELLS`` compiled cells (each process compiles for some seconds)."""
COMPILED_CELLS = 3
RAGGED_LENGTH = 36
SNN_TIME_STEPS = 4
WORLD = 2
STEPS = 6
STOP_STEP = 3
"""Interrupted cells stop after optimizer step 3 (on its boundary, one micro-step into the next window,
or SIGKILLed one micro-step after the periodic save of step 3)."""


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float
    why: str


FP32 = Tolerance(
    1e-5, 1e-6, "the same samples per step; 2 ranks sum the gradient in another order than 1 process"
)
BF16 = Tolerance(
    2e-2,
    2e-3,
    "bf16 keeps 8 bits of mantissa: each rank rounds its own forward and partial gradient, one process "
    "rounds the whole batch's, and 6 steps carry those roundings into the weights",
)
BF16_DEEPSPEED = Tolerance(
    4e-2,
    4e-3,
    "DeepSpeed's bf16 keeps the model itself in bfloat16 (fp32 master weights in the optimizer); the "
    "reference runs fp32 weights under bf16 autocast, and the weights compared are DeepSpeed's bf16 copies",
)


@dataclass(frozen=True)
class Cell:
    backend: str
    precision: str
    accumulation: int
    scheduler: str
    interruption: str
    balance: str = "off"
    topology: str = "ranks"
    model: str = "mlp"
    init: str = "seeded"
    epoch: str = "whole"
    compile: str = "eager"

    @property
    def id(self) -> str:
        balance = "" if self.balance == "off" else f"-balance{self.balance.replace(':', '')}"
        topology = "" if self.topology == "ranks" else f"-{self.topology}"
        model = "" if self.model == "mlp" else f"-{self.model}"
        init = "" if self.init == "seeded" else f"-init{self.init}"
        epoch = "" if self.epoch == "whole" else f"-{self.epoch}"
        compiled = "" if self.compile == "eager" else f"-{self.compile}"
        return (f"{self.backend}-{self.precision}-acc{self.accumulation}-{self.scheduler}-{self.interruption}"
                f"{balance}{topology}{model}{init}{epoch}{compiled}")  # fmt: skip

    @classmethod
    def parse(cls, text: str) -> Cell:
        for cell in all_cells():
            if cell.id == text:
                return cell
        raise SystemExit(f"no matrix cell {text!r}; `python -m tests.matrix --list` prints them")

    @property
    def refusal(self) -> str | None:
        """The clear refusal this cell must meet, or None when it must train like the reference."""
        if self.balance != "off" and self.backend == "deepspeed-zero2":
            return "which backend deepspeed does not support"
        if self.topology == "replicas":
            if self.backend not in ("ddp", "ddp+zero1", "fsdp"):
                return "only the ddp and fsdp backends all-reduce across replica groups"
            if self.backend == "ddp+zero1":
                return "zero_optimization.stage is 1, and the job runs as replica groups"
            if self.balance != "off":
                return "sail.balance is set, and the job runs as replica groups"
            if self.model == "bn":  # torchft all-reduces gradients across groups, not batch statistics
                return "batch statistics are synchronised (snn.sync_batchnorm), and the job runs as replica groups"
            if self.interruption == "window":
                return "cannot save inside a gradient accumulation window with replica groups"
        if self.interruption == "window" and self.backend in ("fsdp", "deepspeed-zero2"):
            return "cannot save inside a gradient accumulation window"
        if self.interruption == "world" and self.backend == "deepspeed-zero2":
            return "was saved by 2 process(es) with DeepSpeed ZeRO stage 2; this run has 1"
        return None

    @property
    def tolerance(self) -> Tolerance:
        if self.precision == "fp32":
            return FP32
        return BF16_DEEPSPEED if self.backend.startswith("deepspeed") else BF16

    def spec(self) -> dict[str, Any]:
        backend, stage = BACKENDS[self.backend]
        return {**asdict(self), "sail_backend": backend, "stage": stage}


def all_cells() -> list[Cell]:
    values = (
        BACKENDS,
        PRECISIONS,
        ACCUMULATIONS,
        SCHEDULERS,
        INTERRUPTIONS,
        BALANCES,
        TOPOLOGIES,
        MODELS,
        INITS,
        EPOCHS,
        COMPILES,
    )
    cells = [Cell(*combination) for combination in itertools.product(*values)]
    # a window to save inside needs an accumulation of more than one micro-step; spiking cells are fp32
    return [
        c for c in cells
        if not (c.interruption == "window" and c.accumulation == 1) and not (c.model == "snn" and c.precision != "fp32")
    ]  # fmt: skip


AXES = ("backend", "interruption", "balance", "topology", "model", "init", "epoch", "compile")
"""Every value of these axes is in every sample."""


def sample(seed: int, count: int) -> list[Cell]:
    """``count`` cells drawn with ``seed``, every value of ``AXES`` present, a replica-group cell that
    must train (ddp, unbalanced), and ``COMPILED_CELLS`` of them compiled."""
    rng = random.Random(seed)
    cells = all_cells()
    rng.shuffle(cells)
    cells.sort(key=lambda c: c.compile != "eager")  # eager ones cover the other axes (stable: still shuffled)
    chosen: list[Cell] = []
    for axis in AXES:
        for value in sorted({getattr(c, axis) for c in cells}):
            if not any(getattr(c, axis) == value for c in chosen):
                chosen.append(next(c for c in cells if getattr(c, axis) == value and c not in chosen))
    if not any(c.topology == "replicas" and not c.refusal for c in chosen):
        chosen.append(
            next(c for c in cells if c.topology == "replicas" and not c.refusal and c not in chosen)
        )
    compiled = [c for c in cells if c.compile != "eager" and c not in chosen]
    chosen += compiled[: max(0, COMPILED_CELLS - sum(c.compile != "eager" for c in chosen))]
    chosen += [c for c in cells if c not in chosen and c.compile == "eager"][: max(0, count - len(chosen))]
    return sorted(chosen, key=lambda c: c.id)


SAMPLE_SIZE = 24
"""Cells per CI run (plus what it takes to cover every backend and interruption): about 10 minutes here."""


def session_seed() -> int:
    """The sample's seed: SAIL_MATRIX_SEED when given (to replay a run), else a new one, kept in the
    environment so that every report of this run names the same."""
    value = os.environ.get("SAIL_MATRIX_SEED") or str(random.SystemRandom().randrange(10**6))
    os.environ["SAIL_MATRIX_SEED"] = value
    return int(value)
