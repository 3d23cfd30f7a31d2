"""Peak memory and time of one SNN training step as T grows, with and without ``snn.time_chunk``.

    python benchmarks/snn_memory.py                      # both models, T = 4, 8, 16, 32, chunks of 4
    python benchmarks/snn_memory.py --models sew --chunk 2 --steps 3
    python benchmarks/snn_memory.py --models sew --size 64 --batch 16 --time-steps 4 16
    python benchmarks/snn_memory.py --models sew --batch 32 --memopt   # spikingjelly's memopt instead
    python benchmarks/snn_memory.py --overhead         # the host work a chunk adds, SEW-ResNet at T=32
    python benchmarks/snn_memory.py --models sew --in-process --batch 32 --size 224 --time-steps 4 16 --chunks 0 4 8

Each measurement runs in a fresh process: the model, one batch and the engine (one process, the
config's ``snn.time_chunk``) are built, the peak counter is reset, and one training step (forward,
``engine.backward``, ``engine.step``) runs. The peak is the **process's resident-set high-water
mark during that step minus its resident set before it** (Linux ``VmHWM`` after resetting it through
``/proc/self/clear_refs``), with glibc's mmap threshold fixed at 64 KiB so that freed tensors leave
the resident set; on a CUDA device it is ``torch.cuda.max_memory_allocated`` over the step instead.
The step times are measured in another fresh process with the allocator as a user runs it (the 64 KiB
threshold maps and unmaps every tensor, which slows a recomputing step far more than a whole one):
the whole and the chunked engine are built side by side, each takes a warm-up step, then they take
``--steps`` steps in turn, one of each at a time, and each one's median is printed (see
``measure_times``). Prints, for each model and T, the peak and time whole and in chunks, and the
ratios the target is stated in: chunked peak at T over chunked peak at T=4 and over the whole
(unchunked) peak at T=4, and chunked time over whole time. Then runs ``time_chunk: "auto"`` with a
budget and prints the chunk it chose.

``--in-process`` (CUDA only) measures every setting in this one process instead, as
``--chunks`` lists them (0 = whole), one after another: build the engine, a warm-up step, the peak
of one step (``max_memory_allocated`` after resetting it, which needs no fresh process), the median
of ``--steps`` timed steps, then the next setting after ``torch.cuda.empty_cache()``. It is quicker
where a device's time is short, but the settings are not interleaved, so the first one timed in the
process can read slower while the GPU warms up (a T=4 row, where every chunk size runs the same
step, shows how much).

``--overhead`` times the host (Python) work a chunk adds besides its kernels, which is what a small
batch on a GPU waits on: the explicit-state forward of the chunk (the neuron state swapped in and
out around the model's call), once in the forward and once in the recompute, through spikingjelly's
``base.to_functional_forward`` (the baseline) and through the chunking's own, both around a model
call that does nothing; and holding the batch norms' running statistics for a recompute.

The models: the example SNN (``examples/snn_digits.py``'s spiking CNN, batch norm per chunk, since
its multi-step batch norm spans T × N) at 32×32 inputs, and spikingjelly's SEW-ResNet-18 (IF neurons,
ADD connections) with batch norm through time (one norm per step, which chunks exactly) at 32×32,
or at ``--size`` pixels (an ImageNet model: at 32×32 its 43 MiB of weight gradients outweigh a time
step's activations, 26 MiB at batch 32).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TIME_STEPS = (4, 8, 16, 32)
BATCH = {"example": 64, "sew": 8}
MEMOPT = "memopt"


def build(model: str, time_steps: int) -> Any:
    from spikingjelly.activation_based import layer, neuron, surrogate

    if model == "example":
        sys.path.insert(0, str(ROOT / "examples"))
        from snn_digits import spiking_cnn

        net = spiking_cnn()
        net[0] = layer.Conv2d(1, 16, 3, padding=1, bias=False)
        net[-2] = layer.Linear(32 * 8 * 8, 10)  # 32×32 inputs: two 2×2 poolings leave 8×8
        return net
    from spikingjelly.activation_based.model import sew_resnet

    return sew_resnet.sew_resnet18(
        num_classes=10, cnf="ADD", spiking_neuron=neuron.IFNode, surrogate_function=surrogate.ATan(),
        detach_reset=True, norm_layer=functools.partial(layer.BatchNormThroughTime2d, time_steps),
    )  # fmt: skip


def training_step(
    model: str, time_steps: int, chunk: int | str, budget: float | None, batch: int, size: int
) -> tuple[Any, Any]:
    """An engine (one process, the config's ``snn.time_chunk``) and one training step of it on one batch."""
    import torch
    import torch.nn.functional as F

    import spikingsail
    from spikingsail.environments import RankInfo
    from spikingsail.snn import firing_rate

    torch.manual_seed(0)
    net = build(model, time_steps)
    channels = 1 if model == "example" else 3
    x = torch.rand(batch, channels, size, size)
    if chunk == MEMOPT:
        spikingjelly_memopt(net, x, time_steps)
        chunk = 0
    snn: dict[str, Any] = {"step_mode": "m", "time_steps": time_steps, "time_chunk": chunk}
    if model == "example":
        snn["chunk_batchnorm"] = "per_chunk"
    if budget is not None:
        snn["memory_budget_mb"] = budget
    engine, _ = spikingsail.initialize(
        model=net, rank_info=RankInfo.single(),
        config={"train_micro_batch_size_per_gpu": batch, "snn": snn,
                "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
                "sail": {"progress_bar": False, "hang_timeout_seconds": 0, "straggler_window": 0}},
    )  # fmt: skip
    x = x.to(engine.device)
    y = torch.randint(0, 10, (batch,), device=engine.device)

    def step() -> None:
        rate = firing_rate(engine(engine.encode(x)))
        engine.backward(F.mse_loss(rate, F.one_hot(y, 10).float()))
        engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()

    return engine, step


def measure_peak(
    model: str, time_steps: int, chunk: int | str, budget: float | None, batch: int, size: int
) -> dict[str, Any]:
    """The peak memory of one training step, in this (fresh) process."""

    engine, step = training_step(model, time_steps, chunk, budget, batch, size)
    if engine.device.type == "cuda":
        peak = cuda_peak(step)
    else:
        before = _rss()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        step()
        peak = _status("VmHWM") - before
    chosen = engine.module.checkpoint_fn.func.choices if chunk == "auto" else {}
    engine.close()
    return {"peak_mib": peak / 2**20, "chosen": [c.steps_per_chunk for c in chosen.values()]}


def cuda_peak(step: Callable[[], None]) -> int:
    """Bytes the CUDA allocator held at its peak during ``step()`` above what it held before."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    return torch.cuda.max_memory_allocated() - before


def measure_times(
    model: str,
    time_steps: int,
    chunks: list[int | str],
    steps: int,
    budget: float | None,
    batch: int,
    size: int,
) -> dict[str, Any]:
    """Median step time of each setting, built side by side in this process and stepped in turn.

    Alternating one step of each setting with the next exposes them to the same moments of the
    machine's load, so their ratio moves less than that of separately timed processes (it still
    moves: up to 16% between runs on a shared 2-core machine).
    """
    runs = [training_step(model, time_steps, chunk, budget, batch, size) for chunk in chunks]
    for _, step in runs:
        step()  # warm-up: the first step allocates what later steps reuse
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(steps):
        for (_, step), kept in zip(runs, times, strict=True):
            start = time.perf_counter()
            step()
            kept.append(time.perf_counter() - start)
    for engine, _ in runs:
        engine.close()
    return {"seconds": [statistics.median(kept) for kept in times]}


def in_process(
    model: str, time_steps: list[int], chunks: list[int], steps: int, batch: int, size: int
) -> None:
    """Every (T, chunk) setting one after another in this process: CUDA peak and median step time."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--in-process measures CUDA max_memory_allocated; on a CPU run without it")
    print(f"{torch.cuda.get_device_name(0)}, {model} batch {batch}, {size}×{size}, torch {torch.__version__}; "
          f"peak MiB / median ms of {steps} steps / time ÷ whole, settings one after another")  # fmt: skip
    for t in time_steps:
        row = []
        for chunk in chunks:
            engine, step = training_step(model, t, chunk, None, batch, size)
            step()
            peak = cuda_peak(step) / 2**20
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            row.append((chunk, peak, statistics.median(times)))
            engine.close()
            del engine, step
            torch.cuda.empty_cache()
        whole = row[0][2]
        print(
            f"T={t}: "
            + "  ".join(f"k={c}: {p:.0f} MiB {s * 1e3:.1f} ms ({s / whole:.2f}×)" for c, p, s in row)
        )


def spikingjelly_memopt(net: Any, x: Any, time_steps: int) -> None:
    """spikingjelly's own ``memopt.optimize_memory`` at level 1 (the level that runs without CUDA):
    every SEW-ResNet ``BasicBlock`` checkpointed over all T, its input compressed where it is
    binary (spikes), probed on the benchmark's batch."""
    from spikingjelly.activation_based import functional, memopt
    from spikingjelly.activation_based.model import sew_resnet

    functional.set_step_mode(net, "m")
    sequence = x.unsqueeze(0).repeat(time_steps, *([1] * x.dim()))

    def example(module: Any) -> Any:
        out = module(sequence)
        functional.reset_net(module)
        return out

    memopt.optimize_memory(net, (sew_resnet.BasicBlock,), example, level=1, checkpoint_budget="memory")
    functional.reset_net(net)


def _rss() -> int:
    return _status("VmRSS")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def in_fresh_process(function: str, *arguments: Any, memory: bool) -> dict[str, Any]:
    """``function(*arguments)`` in a new interpreter: its own allocator, its own peak."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    if memory:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    command = [sys.executable, __file__, "--one", json.dumps([function, *arguments])]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{function}{tuple(arguments)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run_one(
    model: str,
    time_steps: int,
    chunks: list[int | str],
    steps: int,
    batch: int,
    budget: float | None = None,
    size: int = 32,
) -> list[dict[str, Any]]:
    """For each setting its peak (a process each) and its step time (all in one more, stepped in turn)."""
    peaks = [
        in_fresh_process("measure_peak", model, time_steps, chunk, budget, batch, size, memory=True)
        for chunk in chunks
    ]
    seconds = in_fresh_process(
        "measure_times", model, time_steps, chunks, steps, budget, batch, size, memory=False
    )["seconds"]
    return [peak | {"seconds": s} for peak, s in zip(peaks, seconds, strict=True)]


def host_overhead(time_steps: int, repeats: int = 200) -> None:
    """Milliseconds of host work per chunk for the SEW-ResNet (BNTT: T norms per layer)."""
    import timeit

    import torch
    from spikingjelly.activation_based import base, functional

    from spikingsail.config.schema import SNNConfig
    from spikingsail.snn.chunking import TimeChunking, _contexts

    net = build("sew", time_steps)
    functional.set_step_mode(net, "m")
    with torch.no_grad():
        net(torch.rand(1, 2, 3, 32, 32))  # every neuron's state a tensor
    states = tuple(base.extract_memories(net))
    spikingjelly_forward = base.to_functional_forward(net, fn=lambda *inputs: inputs[0])
    chunking = TimeChunking(SNNConfig(step_mode="m", time_chunk=4), net, "benchmark")
    chunking._model = lambda *inputs: inputs[0]  # the model's call, without the model

    def ms(function: Callable[[], Any]) -> float:
        return timeit.timeit(function, number=repeats) / repeats * 1e3

    theirs = ms(lambda: spikingjelly_forward((None,), states))
    ours = ms(lambda: chunking._run_chunk(1, None, *states))

    def hold() -> None:
        with _contexts(chunking._norms)[1]:
            pass

    held = ms(hold)
    modules = sum(1 for _ in net.modules())
    print(f"SEW-ResNet-18 at T={time_steps}: {modules} modules, {len(states)} neuron states, "
          f"{len(chunking._norms)} batch norms; ms of host work, mean of {repeats}")  # fmt: skip
    print(
        f"explicit-state forward, spikingjelly's: {theirs:.3f}   the chunking's: {ours:.3f}   ratio {ours / theirs:.3f}"
    )
    print(f"holding running statistics for a recompute: {held:.3f}")
    print(f"per recomputed chunk (two explicit-state forwards and a hold): {2 * ours + held:.3f} "
          f"(with spikingjelly's forward: {2 * theirs + held:.3f})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["example", "sew"], choices=["example", "sew"])
    parser.add_argument("--chunk", type=int, default=4, help="time steps per chunk (snn.time_chunk)")
    parser.add_argument("--memopt", action="store_true",
                        help="instead of chunks: spikingjelly's memopt.optimize_memory, level 1 (sew only)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    parser.add_argument("--budget", type=float, default=None, help="MiB for the time_chunk auto run")
    parser.add_argument("--batch", type=int, default=None, help="batch size instead of the model's default")
    parser.add_argument("--size", type=int, default=32, help="input height and width (sew only)")
    parser.add_argument("--time-steps", type=int, nargs="+", default=list(TIME_STEPS), help="the T values")
    parser.add_argument(
        "--overhead", action="store_true", help="the host work a chunk adds (SEW-ResNet, last T)"
    )
    parser.add_argument("--in-process", action="store_true",
                        help="CUDA only: every setting in this process, one after another (see above)")  # fmt: skip
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 4],
                        help="with --in-process: the chunk sizes to measure, 0 = whole, first")  # fmt: skip
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.overhead:
        host_overhead(args.time_steps[-1])
        return
    if args.in_process:
        for model in args.models:
            in_process(model, args.time_steps, args.chunks, args.steps, args.batch or BATCH[model], args.size)
        return
    if args.one:
        logging.basicConfig(level=logging.WARNING)
        name, *arguments = json.loads(args.one)
        functions: dict[str, Callable[..., dict[str, Any]]] = {
            "measure_peak": measure_peak,
            "measure_times": measure_times,
        }
        print(json.dumps(functions[name](*arguments)))
        return
    import torch

    if args.size != 32 and args.models != ["sew"]:
        parser.error("--size is for --models sew (the example CNN's classifier is sized for 32×32)")
    if args.memopt and args.models != ["sew"]:
        parser.error("--memopt is for --models sew (it checkpoints the SEW-ResNet's BasicBlocks)")
    other: int | str = MEMOPT if args.memopt else args.chunk
    name = "memopt" if args.memopt else "chunked"
    what = "spikingjelly memopt level 1" if args.memopt else f"chunks of {args.chunk} steps"
    print(f"peak = {'CUDA max_memory_allocated' if torch.cuda.is_available() else 'resident-set high-water mark'}"
          f" over one training step, MiB; time = median s/step; {what}")  # fmt: skip
    for model in args.models:
        batch = args.batch or BATCH[model]
        print(f"\n{model} (batch {batch}, {args.size}×{args.size})")
        print(
            f"{'T':>4}{'peak whole':>12}{f'peak {name}':>14}{f'{name}/T={args.time_steps[0]}':>13}"
            f"{f'/whole T={args.time_steps[0]}':>15}{'s whole':>10}"
            f"{f's {name}':>11}{'time ratio':>12}"
        )
        base = base_whole = None
        last = None
        for t in args.time_steps:
            whole, chunked = run_one(model, t, [0, other], args.steps, batch, size=args.size)
            base = base or chunked["peak_mib"]
            base_whole = base_whole or whole["peak_mib"]
            last = whole
            print(f"{t:>4}{whole['peak_mib']:>12.1f}{chunked['peak_mib']:>14.1f}{chunked['peak_mib'] / base:>13.2f}"
                  f"{chunked['peak_mib'] / base_whole:>15.2f}"
                  f"{whole['seconds']:>10.3f}{chunked['seconds']:>11.3f}{chunked['seconds'] / whole['seconds']:>12.2f}")  # fmt: skip
        if args.memopt:
            continue
        budget = args.budget or (last["peak_mib"] / 4 if last else 100.0)
        (auto,) = run_one(model, args.time_steps[-1], ["auto"], args.steps, batch, budget, args.size)
        print(f'time_chunk "auto", memory_budget_mb {budget:.0f}, T={args.time_steps[-1]}: chose chunks of {auto["chosen"]} '
              f"step(s); peak {auto['peak_mib']:.1f} MiB, {auto['seconds']:.3f} s/step")  # fmt: skip


if __name__ == "__main__":
    main()
