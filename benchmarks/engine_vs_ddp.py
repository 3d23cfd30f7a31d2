"""Step time of the SpikingSail engine against the same backend used by hand, on 2 gloo ranks.

    python benchmarks/engine_vs_ddp.py                   # re-launches itself with `sail launch -n 2`
    python benchmarks/engine_vs_ddp.py --steps 400
    python benchmarks/engine_vs_ddp.py --backend fsdp    # engine on FSDP2 against a fully_shard loop
    python benchmarks/engine_vs_ddp.py --backend deepspeed --zero-stage 2   # against DeepSpeed's own loop
    python benchmarks/engine_vs_ddp.py --backend horovod    # under horovodrun, against a Horovod loop
    python benchmarks/engine_vs_ddp.py --calls           # Python calls per step (cProfile), tiny model

Both loops train the same model on the same pre-made batches in the same process group; their
steps alternate one by one, so machine noise and allocator state hit both alike (alternating in
blocks of steps biased the tiny model's ratio by up to ±10%). Prints the median step time of each
after warm-up and their ratio (engine / by hand) for a tiny and a mid-size model, and the cost of the
engine's own monitoring: the engine as configured by default (hang-watch heartbeat and straggler
breakdown on) over the same engine with both off (``hang_timeout_seconds: 0``, ``straggler_window: 0``),
and over the engine with the heartbeat alone off — more loops in the same alternation. The tiny
model's ratios move by several percent between runs, more than the heartbeat costs; so its cost is
also timed directly: the three enter/leave pairs of a training micro-step, a million times. The FSDP2 loop
shards each child with parameters and then the root, as the engine's backend does; the DeepSpeed
loop is DeepSpeed's own ``engine(x); engine.backward(loss); engine.step()`` with the same ZeRO stage;
the Horovod loop is Horovod's documented one (``hvd.DistributedOptimizer``, ``broadcast_parameters``),
both started by horovodrun.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import spikingsail
from spikingsail.monitor.hangwatch import BACKWARD, FORWARD, OPTIMIZER
from spikingsail.monitor.heartbeat import Heartbeat

MODELS: dict[str, Callable[[], nn.Module]] = {
    "tiny (9.6k params)": lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)),
    "mid (5.3M params)": lambda: nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1536), nn.ReLU(), nn.Linear(1536, 10)
    ),
}
MICRO_BATCH = 32
WARMUP = 30


def batches(model: nn.Module, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    features = next(model.parameters()).shape[1]
    g = torch.Generator().manual_seed(dist.get_rank())
    return [
        (torch.randn(MICRO_BATCH, features, generator=g), torch.randint(0, 10, (MICRO_BATCH,), generator=g))
        for _ in range(count)
    ]


def interleaved(
    steps: tuple[Callable[[torch.Tensor, torch.Tensor], None], ...],
    data: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[list[float]]:
    """Run every step function on each batch in turn; per function, the time of each call."""
    times: list[list[float]] = [[] for _ in steps]
    for x, y in data:
        for step, bucket in zip(steps, times, strict=True):
            start = time.perf_counter()
            step(x, y)
            bucket.append(time.perf_counter() - start)
    return times


Step = Callable[[torch.Tensor, torch.Tensor], None]


def deepspeed_own(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batch: int, stage: int) -> Step:
    """DeepSpeed's own loop at a ZeRO stage, as its documentation shows: ``deepspeed.initialize``,
    ``ds(x)``, ``ds.backward(loss)``, ``ds.step()``."""
    import deepspeed

    ds, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config={
            "train_micro_batch_size_per_gpu": micro_batch,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,  # plain SGD, as the engine's loop uses
            "steps_per_print": 2**62,
        },
    )

    def ds_step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(ds(x), y)
        ds.backward(loss)
        ds.step()

    return ds_step


def by_hand(model: nn.Module, backend: str, stage: int) -> Step:
    """The backend used directly, as its own documentation shows, with plain SGD."""
    if backend == "deepspeed":
        return deepspeed_own(model, torch.optim.SGD(model.parameters(), lr=0.01), MICRO_BATCH, stage)
    if backend == "horovod":
        import horovod.torch as hvd

        hvd.init()
        hvd_optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
        )
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)

        def hvd_step(x: torch.Tensor, y: torch.Tensor) -> None:
            hvd_optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            hvd_optimizer.step()

        return hvd_step
    if backend == "ddp":
        wrapped: nn.Module = DistributedDataParallel(model)
    else:
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child)
        wrapped = fully_shard(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01)

    def hand_step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(wrapped(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return hand_step


def engine_loop(base: nn.Module, backend: str, stage: int, **sail: object) -> tuple[Step, Callable[[], None]]:
    model = copy.deepcopy(base)
    engine, _ = spikingsail.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        config={
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "sail": {"progress_bar": False, "backend": backend, **sail},
            "zero_optimization": {"stage": stage},
        },
    )

    def engine_step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()

    return engine_step, engine.close


def compare(
    name: str, make: Callable[[], nn.Module], steps: int, backend: str, stage: int, warmup: int
) -> tuple[float, float, float, float]:
    torch.manual_seed(0)
    base = make()
    hand_step = by_hand(copy.deepcopy(base), backend, stage)
    engine_step, close = engine_loop(base, backend, stage)
    bare_step, close_bare = engine_loop(base, backend, stage, hang_timeout_seconds=0, straggler_window=0)
    quiet_step, close_quiet = engine_loop(base, backend, stage, hang_timeout_seconds=0)
    loops = (hand_step, engine_step, bare_step, quiet_step)
    interleaved(loops, batches(base, warmup))
    times = interleaved(loops, batches(base, steps))
    close()
    close_bare()
    close_quiet()
    hand, engine, bare, quiet = (statistics.median(t) for t in times)
    return hand, engine, bare, quiet


def calls_per_step(step: Step, data: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Python calls (functions and builtins, as cProfile counts them) per step of ``step``, after warm-up."""
    import cProfile
    import pstats

    for x, y in data[:WARMUP]:
        step(x, y)
    profile = cProfile.Profile()
    profile.enable()
    for x, y in data:
        step(x, y)
    profile.disable()
    return float(pstats.Stats(profile).total_calls) / len(data)  # type: ignore[attr-defined]


def fabric_loop(base: nn.Module) -> Step | None:
    """Lightning Fabric's documented loop on the same process group, where lightning is installed."""
    try:
        from lightning.fabric import Fabric
    except ImportError:
        return None
    # under torchrun, as Fabric's docs start it: launch() starts no process and joins the job's group
    fabric = Fabric(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy="ddp")
    fabric.launch()
    model, optimizer = fabric.setup(base, torch.optim.SGD(base.parameters(), lr=0.01))

    def fabric_step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return fabric_step


def count_calls(steps: int) -> list[tuple[str, float]]:
    """Calls per optimizer step of the tiny model's loops (rank 0's; every rank runs them alike)."""
    torch.manual_seed(0)
    base = next(iter(MODELS.values()))()
    data = batches(base, steps)
    rows = [("ddp by hand", calls_per_step(by_hand(copy.deepcopy(base), "ddp", 0), data))]
    for name, sail in (("engine, defaults", {}),
                       ("engine, monitoring off", {"hang_timeout_seconds": 0, "straggler_window": 0})):  # fmt: skip
        step, close = engine_loop(base, "ddp", 0, **sail)
        rows.append((name, calls_per_step(step, data)))
        close()
    fabric = fabric_loop(copy.deepcopy(base))
    if fabric is not None:
        rows.append(("Lightning Fabric", calls_per_step(fabric, data)))
    return rows


def heartbeat_cost(rounds: int) -> float:
    """Seconds per micro-step of the heartbeat alone: forward, backward and step each enter and leave."""
    beat = Heartbeat(0, stacks=False)  # the record in a memfd page, as a rank's
    start = time.perf_counter()
    for _ in range(rounds):
        beat.enter(FORWARD)
        beat.leave(0, 0)
        beat.enter(BACKWARD, collective=True)
        beat.leave(0, 0)
        beat.enter(OPTIMIZER, collective=True)
        beat.leave(0, 0)
    elapsed = time.perf_counter() - start
    beat.close()
    return elapsed / rounds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="measured steps per loop and model")
    parser.add_argument("--backend", choices=["ddp", "fsdp", "deepspeed", "horovod"], default="ddp")
    parser.add_argument("--zero-stage", type=int, default=0, help="ZeRO stage for --backend deepspeed")
    parser.add_argument("--calls", action="store_true", help="count Python calls per step instead of timing")
    parser.add_argument("--small", action="store_true",
                        help="2 warm-up steps and 1,000 heartbeat rounds: that it runs, not what it measures (CI)")  # fmt: skip
    args = parser.parse_args()
    sail = [sys.executable, "-m", "spikingsail.cli.main", "launch"]
    if args.backend == "horovod":
        if "HOROVOD_RANK" not in os.environ:
            os.execv(sys.executable, [*sail, "--launcher", "horovodrun", "-np", "2", __file__, *sys.argv[1:]])
        os.environ.setdefault("RANK", os.environ["HOROVOD_RANK"])
        os.environ.setdefault("WORLD_SIZE", os.environ["HOROVOD_SIZE"])
    elif "RANK" not in os.environ:
        os.execv(sys.executable, [*sail, "-n", "2", __file__, *sys.argv[1:]])
    dist.init_process_group("gloo")
    if args.calls:
        counted = count_calls(args.steps)
        if dist.get_rank() == 0:
            print(f"\n{'loop (tiny model, 2 gloo ranks)':<34}{'calls/step':>11}{'over by hand':>14}")
            for name, calls in counted:
                print(f"{name:<34}{calls:>11.1f}{calls - counted[0][1]:>+14.1f}")
            print(f"(cProfile's count on rank 0 over {args.steps} steps after {WARMUP} of warm-up; "
                  "the engine's defaults print every 10 steps and compare the ranks every 20)")  # fmt: skip
        dist.destroy_process_group()
        return
    rows = [
        (name, *compare(name, make, args.steps, args.backend, args.zero_stage, 2 if args.small else WARMUP))
        for name, make in MODELS.items()
    ]
    if dist.get_rank() == 0:
        hand = f"{args.backend} ms/step"
        print(
            f"\n{'model':<22}{hand:>14}{'engine ms/step':>16}{'ratio':>8}{'monitoring':>12}{'heartbeat':>11}"
        )
        for name, hand_time, engine_time, bare_time, quiet_time in rows:
            print(
                f"{name:<22}{hand_time * 1e3:>14.3f}{engine_time * 1e3:>16.3f}{engine_time / hand_time:>8.3f}"
                f"{engine_time / bare_time:>12.3f}{engine_time / quiet_time:>11.3f}"
            )
        print(
            "monitoring: the engine as by default (hang-watch heartbeat and straggler breakdown on) over the "
            "same engine with both off; heartbeat: over the engine with the heartbeat alone off"
        )
        beat = heartbeat_cost(1_000 if args.small else 1_000_000)
        tiny_step = rows[0][2]
        print(f"heartbeat alone: {beat * 1e6:.2f} µs per micro-step = {100 * beat / tiny_step:.2f}% of the tiny "
              "model's engine step")  # fmt: skip
        print(
            f"(median of {args.steps} steps each, micro batch {MICRO_BATCH}, "
            f"{dist.get_world_size()} gloo ranks, torch {torch.__version__}"
            + (f", ZeRO stage {args.zero_stage})" if args.backend == "deepspeed" else ")")
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
