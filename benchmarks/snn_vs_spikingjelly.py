"""SNN step time through the engine against spikingjelly's own data-parallel ways, on 2 gloo ranks.

    python benchmarks/snn_vs_spikingjelly.py            # re-launches itself with `sail launch -n 2`
    python benchmarks/snn_vs_spikingjelly.py --steps 200

Both loops train the same multi-step spiking CNN (LIF neurons, surrogate gradients, T time steps)
on the same pre-made batches in the same process group. The hand-written loop is what
spikingjelly's examples do: encode by repeating the input T times, forward, loss on the firing
rate, backward, step, ``functional.reset_net``. The third is spikingjelly 2.0's
``activation_based.distributed.vision`` training step, built from its own pieces: the input made by
its ``_classification_sequence`` path (``_forward_classification``: repeat T times, contiguous, mean
of the outputs over T), its ``_classification_loss``, backward, step, ``reset_net``; the model in DDP
with ``broadcast_buffers`` as its ``_wrap_data_parallel`` sets it for multi-step models (that function
passes ``device_ids=[device.index]``, which DDP refuses for a CPU module, so the wrap is made here
with ``device_ids=None``; its trainer also calls ``torch.cuda.synchronize`` every step, so it cannot
run on a CPU as it is). The engine loop calls ``engine.encode`` and leaves the reset to the engine.
The three steps alternate one by one; prints the median step time of each after warm-up and the
ratios (engine / hand-written, engine / spikingjelly distributed).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from engine_vs_ddp import interleaved  # this directory is on sys.path when a benchmark runs
from spikingjelly.activation_based import functional, layer, neuron, surrogate
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import spikingsail
from spikingsail.snn import firing_rate

MICRO_BATCH = 32
T = 4
WARMUP = 20


def spiking_cnn() -> nn.Module:
    def lif() -> nn.Module:
        return neuron.LIFNode(tau=2.0, surrogate_function=surrogate.ATan(), detach_reset=True)

    net = nn.Sequential(
        layer.Conv2d(1, 16, 3, padding=1, bias=False), layer.BatchNorm2d(16), lif(), layer.MaxPool2d(2),
        layer.Conv2d(16, 32, 3, padding=1, bias=False), layer.BatchNorm2d(32), lif(), layer.MaxPool2d(2),
        layer.Flatten(), layer.Linear(32 * 4 * 4, 10), lif(),
    )  # fmt: skip
    functional.set_step_mode(net, "m")
    return net


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(dist.get_rank())
    return [(torch.rand(MICRO_BATCH, 1, 16, 16, generator=g), torch.randint(0, 10, (MICRO_BATCH,), generator=g))
            for _ in range(count)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=150, help="measured steps per loop")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        os.execv(sys.executable,
                 [sys.executable, "-m", "spikingsail.cli.main", "launch", "-n", "2", __file__, *sys.argv[1:]])  # fmt: skip
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    base = spiking_cnn()

    ddp = DistributedDataParallel(copy.deepcopy(base))
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)

    def hand_written(x: torch.Tensor, y: torch.Tensor) -> None:
        rate = ddp(x.unsqueeze(0).repeat(T, 1, 1, 1, 1)).mean(0)
        F.mse_loss(rate, F.one_hot(y, 10).float()).backward()
        ddp_opt.step()
        ddp_opt.zero_grad(set_to_none=True)
        functional.reset_net(ddp)

    from spikingjelly.activation_based.distributed.vision import execution

    sj_dp = DistributedDataParallel(copy.deepcopy(base), broadcast_buffers=True)  # its multi-step setting
    sj_opt = torch.optim.Adam(sj_dp.parameters(), lr=1e-3)

    def rate_mse(rate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(rate, F.one_hot(y, 10).float())

    def spikingjelly_distributed(x: torch.Tensor, y: torch.Tensor) -> None:
        rate = execution._forward_classification(sj_dp, x, T, "m", "NCHW")
        execution._classification_loss(rate, y, rate_mse).backward()
        sj_opt.step()
        sj_opt.zero_grad(set_to_none=True)
        functional.reset_net(sj_dp)

    model = copy.deepcopy(base)
    engine, _ = spikingsail.initialize(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
        config={"train_micro_batch_size_per_gpu": MICRO_BATCH, "snn": {"time_steps": T},
                "sail": {"progress_bar": False}},
    )  # fmt: skip

    def through_engine(x: torch.Tensor, y: torch.Tensor) -> None:
        rate = firing_rate(engine(engine.encode(x)))
        engine.backward(F.mse_loss(rate, F.one_hot(y, 10).float()))
        engine.step()

    loops = (hand_written, spikingjelly_distributed, through_engine)
    interleaved(loops, batches(WARMUP))
    hand_times, sj_times, engine_times = interleaved(loops, batches(args.steps))
    engine.close()
    if dist.get_rank() == 0:
        hand, sj, eng = (statistics.median(t) for t in (hand_times, sj_times, engine_times))
        print(f"\n{'spikingjelly + DDP':>20}{'sj distributed':>16}{'engine':>10}{'engine/DDP':>12}{'engine/sj dist':>16}"
              "   (ms/step)")  # fmt: skip
        print(f"{hand * 1e3:>20.2f}{sj * 1e3:>16.2f}{eng * 1e3:>10.2f}{eng / hand:>12.3f}{eng / sj:>16.3f}")
        print(f"(median of {args.steps} steps each, micro batch {MICRO_BATCH}, T={T}, 16×16 inputs, "
              f"{dist.get_world_size()} gloo ranks, torch {torch.__version__})")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
