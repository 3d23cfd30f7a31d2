"""Seed 001's Horovod job (``train_hvd.py`` beside this file) on the engine: ``sail.backend:
horovod`` in the config does what the seed wires by hand (``hvd.init``, the sampler,
``hvd.DistributedOptimizer``, the two broadcasts); ``horovod.compression`` / ``horovod.op`` are its
``--fp16-allreduce`` / ``--use-adasum`` and ``gradient_accumulation_steps`` its
``backward_passes_per_step``.

    horovodrun -np 2 -H localhost:2 python examples/horovod/train.py
    sail launch --launcher horovodrun -n 2 examples/horovod/train.py
    sail launch -n 2 examples/horovod/train.py            # torchrun: the same backend, no horovodrun
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import spikingsail
from spikingsail.data.digits import load_digits_split


def config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": args.batches_per_allreduce,
        "horovod": {
            "compression": "fp16" if args.fp16_allreduce else "none",
            "op": "Adasum" if args.use_adasum else "Average",
        },
        "sail": {"backend": "horovod", "seed": 0},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--base-lr", type=float, default=0.01)
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--use-adasum", action="store_true")
    parser.add_argument("--batches-per-allreduce", type=int, default=1)
    parser = spikingsail.add_config_arguments(parser)
    args = parser.parse_args()

    train_set, test_set = load_digits_split()
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr, momentum=0.9)
    engine, optimizer = spikingsail.SpikingSail(args, model, optimizer,
                                                config=None if args.sail_config else config(args)).run()  # fmt: skip
    for group in optimizer.param_groups:  # the seed's scaling by the number of ranks (not with Adasum)
        group["lr"] = args.base_lr * (engine.world_size if not args.use_adasum else 1)
    loader = engine.dataloader(train_set, shuffle=True, drop_last=True)
    for _epoch in range(loader.epoch, args.epochs):
        for data, target in loader:
            engine.backward(F.cross_entropy(engine(data), target))
            engine.step()
    engine.eval()
    counts = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for data, target in engine.dataloader(test_set, shuffle=False, pad=False):
            counts += torch.tensor([(engine(data).argmax(1) == target).sum().item(), len(target)])
    correct, total = engine.all_reduce(counts).tolist()
    if engine.rank == 0:
        print(
            f"test accuracy: {correct / total:.4f} ({int(total)} images, {engine.world_size} processes)",
            flush=True,
        )
    engine.close()


if __name__ == "__main__":
    main()
