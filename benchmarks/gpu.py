"""The engine's throughput against the plain loop a user would write, on one GPU: one table.

    python benchmarks/gpu.py             # on a GPU, in about 5 minutes; re-launches itself with `sail launch -n 1`
    python benchmarks/gpu.py --small     # every row at a toy size (a CPU too: what CI runs so that it cannot rot)
    python benchmarks/gpu.py --rows resnet50-eager sew18-t4-torch --steps 50

Each row trains one model two ways in the same process, on the same batches already in the
device's memory: the plain loop (the model, ``torch.optim.SGD``, ``loss.backward()``,
``optimizer.step()``, with the row's autocast, ``torch.compile`` and, for a spiking network,
``functional.reset_net`` after each step, as spikingjelly's examples do) and the engine
(``engine(x)``, ``engine.backward(loss)``, ``engine.step()``) configured to do the same. Their steps
alternate one by one (``engine_vs_ddp.interleaved``), each ending in a device synchronisation;
after warm-up steps, each loop's median step time gives images/s. The row's ratio is the engine's
images/s over the plain loop's: 1.00 means the engine adds nothing. "step MiB" is the most device
memory a step allocated beyond what was allocated before it (activations, gradients, and optimizer
state on the first step), the larger of the two loops' (on a CPU: not measured).

The rows:

* ``resnet50-eager``, ``resnet50-compiled``: torchvision's ResNet-50, bf16 autocast, channels_last
  (its reference recipe's settings), 224×224, batch 128; compiled: ``torch.compile(model)`` against
  ``"compile": {"enabled": true}``;
* ``resnet50-monitoring-off``: the eager row with the engine's hang watch and straggler breakdown off
  (``hang_timeout_seconds: 0``, ``straggler_window: 0``): the cost of monitoring is this row's ratio
  against the eager one's;
* ``resnet50-zero2``, ``resnet50-fsdp2``: fp32 (DeepSpeed's bf16 is a bf16 model, not autocast),
  contiguous (ZeRO flattens every parameter into one buffer, which a channels_last weight cannot
  join), the engine on DeepSpeed ZeRO-2 and on FSDP2 over one GPU, against the plain fp32 loop;
* ``resnet50-zero2-vs-deepspeed``: the engine on ZeRO-2 against DeepSpeed's own loop at the same
  stage (``deepspeed.initialize``, ``ds(x)``, ``ds.backward(loss)``, ``ds.step()``, the same SGD):
  what the engine adds to DeepSpeed, where the row above counts DeepSpeed's own cost too;
* ``sew18-t4-torch``, ``sew18-t4-fused``, ``sew18-t16-torch``, ``sew18-t16-fused``: spikingjelly's
  SEW-ResNet-18 (IF neurons, ADD connections), multi-step, T = 4 and 16, 128×128, batch 32, fp32; the
  neurons on spikingjelly's torch ops and on its fused Triton kernels (``snn.backend``); both loops
  run on the row's kernels (the choice is the process's).

``--small`` shrinks every row (one block per stage, 10 classes, 32×32 inputs, batch 2, a few
steps); on a CPU (where it is the only size) the fused rows run the torch ops, marked so, and the
compiled row compiles with ``aot_eager`` (AOTAutograd's graphs without inductor's code generation,
a minute of a CPU's time for this model: inductor's exactness on a CPU is what the differential
matrix's compiled cells check). CI runs it (tests/tooling/test_gpu_benchmark.py) so that the script
cannot rot.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import os
import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from engine_vs_ddp import deepspeed_own, interleaved  # this directory is on sys.path when a benchmark runs
from torch import nn

import spikingsail


@dataclass(frozen=True)
class Row:
    name: str
    model: str  # "resnet50" or "sew18"
    bf16: bool = False
    compiled: bool = False
    backend: str = "ddp"
    zero_stage: int = 0
    monitoring: bool = True
    time_steps: int = 0  # a spiking network's T
    kernels: str = "torch"  # snn.backend
    baseline: str = "torch"  # the loop measured against: plain torch, or "deepspeed"'s own

    @property
    def channels_last(self) -> bool:
        """The reference recipe's layout, for the bf16 rows (ZeRO flattens parameters: contiguous only)."""
        return self.bf16


ROWS = (
    Row("resnet50-eager", "resnet50", bf16=True),
    Row("resnet50-monitoring-off", "resnet50", bf16=True, monitoring=False),
    Row("resnet50-zero2", "resnet50", backend="deepspeed", zero_stage=2),
    Row("resnet50-zero2-vs-deepspeed", "resnet50", backend="deepspeed", zero_stage=2, baseline="deepspeed"),
    Row("resnet50-fsdp2", "resnet50", backend="fsdp"),
    Row("sew18-t4-torch", "sew18", time_steps=4),
    Row("sew18-t4-fused", "sew18", time_steps=4, kernels="triton"),
    Row("sew18-t16-torch", "sew18", time_steps=16),
    Row("sew18-t16-fused", "sew18", time_steps=16, kernels="triton"),
    Row("resnet50-compiled", "resnet50", bf16=True, compiled=True),  # last: its compilations take longest
)


@dataclass(frozen=True)
class Size:
    small: bool
    image: int
    batch: int
    snn_image: int
    snn_batch: int
    warmup: int
    steps: int
    compiler: str = "inductor"
    """torch.compile's backend for the compiled row"""

    def of(self, row: Row) -> tuple[int, int]:
        """The row's image side and batch."""
        return (self.snn_image, self.snn_batch) if row.time_steps else (self.image, self.batch)


FULL = Size(small=False, image=224, batch=128, snn_image=128, snn_batch=32, warmup=5, steps=20)
SMALL = Size(
    small=True, image=32, batch=2, snn_image=32, snn_batch=2, warmup=1, steps=3, compiler="aot_eager"
)
CLASSES = 1000


def build(row: Row, small: bool) -> nn.Module:
    """The row's model; small: the same architecture with one block per stage and 10 classes."""
    torch.manual_seed(0)
    layers = [1, 1, 1, 1] if small else None
    classes = 10 if small else CLASSES
    if row.model == "resnet50":
        from torchvision.models import resnet

        if small:
            return resnet.ResNet(resnet.Bottleneck, layers, num_classes=classes)
        return resnet.resnet50(num_classes=classes)
    from spikingjelly.activation_based import functional, neuron, surrogate
    from spikingjelly.activation_based.model import sew_resnet

    net = sew_resnet.SEWResNet(
        sew_resnet.BasicBlock, layers or [2, 2, 2, 2], num_classes=classes, cnf="ADD",
        spiking_neuron=neuron.IFNode, surrogate_function=surrogate.ATan(), detach_reset=True,
    )  # fmt: skip
    functional.set_step_mode(net, "m")
    return net


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    """torchvision's reference recipe: SGD, momentum 0.9, weight decay 1e-4."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def batches(
    row: Row, size: Size, device: torch.device, count: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    image, batch = size.of(row)
    data = []
    for _ in range(count):
        x = torch.randn(batch, 3, image, image, generator=generator).to(device)
        if row.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        classes = 10 if size.small else CLASSES
        data.append((x, torch.randint(0, classes, (batch,), generator=generator).to(device)))
    return data


def spiking_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.mean(0), y)  # the firing rate over T, as spikingjelly's examples


def plain_loop(
    row: Row, model: nn.Module, size: Size, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The loop a user writes without the engine."""
    if row.baseline == "deepspeed":
        return deepspeed_loop(row, model, size, device)
    model = model.to(device)
    if row.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = optimizer_for(model)
    forward = torch.compile(model, backend=size.compiler) if row.compiled else model
    autocast = functools.partial(torch.autocast, device.type, torch.bfloat16, enabled=row.bf16)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with autocast():
            if row.time_steps:
                loss = spiking_loss(forward(x.unsqueeze(0).repeat(row.time_steps, 1, 1, 1, 1)), y)
            else:
                loss = F.cross_entropy(forward(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if row.time_steps:
            from spikingjelly.activation_based import functional

            functional.reset_net(model)
        _synchronize(device)

    return step


def deepspeed_loop(
    row: Row, model: nn.Module, size: Size, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """DeepSpeed's own loop at the row's ZeRO stage, with the same SGD."""
    ds_step = deepspeed_own(model, optimizer_for(model), size.of(row)[1], row.zero_stage)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        ds_step(x, y)
        _synchronize(device)

    return step


def engine_loop(
    row: Row, model: nn.Module, size: Size, kernels: str
) -> tuple[Any, Callable[[torch.Tensor, torch.Tensor], None]]:
    """The same training through the engine, configured to do what the plain loop does."""
    if row.channels_last:
        model = model.to(memory_format=torch.channels_last)
    sail: dict[str, Any] = {"backend": row.backend, "progress_bar": False}
    if not row.monitoring:
        sail.update(hang_timeout_seconds=0, straggler_window=0)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": size.of(row)[1],
        "sail": sail, "bf16": {"enabled": row.bf16},
        "compile": {"enabled": row.compiled, "backend": size.compiler},
    }  # fmt: skip
    if row.zero_stage:
        config["zero_optimization"] = {"stage": row.zero_stage}
    if row.time_steps:
        config["snn"] = {"step_mode": "m", "time_steps": row.time_steps, "backend": kernels}
    engine, _ = spikingsail.initialize(model=model, optimizer=optimizer_for(model), config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = spiking_loss(engine(engine.encode(x)), y) if row.time_steps else F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        _synchronize(engine.device)

    return engine, step


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def with_peak(step: Callable[..., None], device: torch.device, peaks: list[int]) -> Callable[..., None]:
    """``step``, noting the most memory it allocated beyond what was allocated before it."""
    if device.type != "cuda":
        return step

    def measured(x: torch.Tensor, y: torch.Tensor) -> None:
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step(x, y)
        peaks.append(torch.cuda.max_memory_allocated(device) - before)

    return measured


def measure(row: Row, size: Size, device: torch.device) -> dict[str, Any]:
    kernels = row.kernels
    note = ""
    if kernels != "torch" and device.type != "cuda":
        kernels, note = "torch", "fused kernels need CUDA: torch ops here"
    if row.baseline == "deepspeed":
        note = "plain: DeepSpeed's own loop"
    base = build(row, size.small)
    engine, through_engine = engine_loop(row, copy.deepcopy(base), size, kernels)  # sets the kernels first
    try:
        by_hand = plain_loop(row, copy.deepcopy(base), size, engine.device)
        peaks: tuple[list[int], list[int]] = ([], [])
        loops = (
            with_peak(by_hand, engine.device, peaks[0]),
            with_peak(through_engine, engine.device, peaks[1]),
        )
        interleaved(loops, batches(row, size, engine.device, size.warmup))
        plain_times, engine_times = interleaved(loops, batches(row, size, engine.device, size.steps))
    finally:
        engine.close()
    batch = size.of(row)[1]
    plain, mine = (batch / statistics.median(t) for t in (plain_times, engine_times))
    peak = max(max(p, default=0) for p in peaks) / 2**20 if device.type == "cuda" else None
    return {
        "row": row.name,
        "plain": plain,
        "engine": mine,
        "ratio": mine / plain,
        "peak": peak,
        "note": note,
    }


def table(results: list[dict[str, Any]], device: str, size: Size) -> str:
    lines = [
        f"{'row':<26}{'plain img/s':>13}{'engine img/s':>14}{'engine÷plain':>14}{'step MiB':>10}  note",
    ]
    for r in results:
        peak = f"{r['peak']:>10.0f}" if r["peak"] is not None else f"{'-':>10}"
        lines.append(
            f"{r['row']:<26}{r['plain']:>13.4g}{r['engine']:>14.4g}{r['ratio']:>14.3f}{peak}  {r['note']}"
        )
    lines.append(
        f"({device}; median of {size.steps} alternating steps after {size.warmup} warm-up steps each)"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="every row at a toy size (CI, a CPU)")
    parser.add_argument("--rows", nargs="+", choices=[r.name for r in ROWS], help="only these rows")
    parser.add_argument("--steps", type=int, help="measured steps per loop and row")
    args = parser.parse_args()
    if "RANK" not in os.environ:  # one process with a process group of one, as DeepSpeed and FSDP2 need
        os.execv(sys.executable,
                 [sys.executable, "-m", "spikingsail.cli.main", "launch", "-n", "1", __file__, *sys.argv[1:]])  # fmt: skip
    small = args.small or not torch.cuda.is_available()
    size = SMALL if small else FULL
    if args.steps:
        size = Size(**{**size.__dict__, "steps": args.steps})
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    results = []
    failed = []
    for row in ROWS:
        if args.rows and row.name not in args.rows:
            continue
        try:
            results.append(measure(row, size, device))
        except Exception:  # the other rows still run: a lent GPU's time is short
            traceback.print_exc()
            failed.append(row.name)
            print(f"{row.name}: FAILED (its traceback above)", flush=True)
            continue
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"{row.name}: engine÷plain {results[-1]['ratio']:.3f}", flush=True)
    print()
    print(table(results, f"{name}, {'small' if size.small else 'full'} size", size))
    if failed:
        print(f"failed rows: {' '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
