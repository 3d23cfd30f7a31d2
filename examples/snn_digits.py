"""A spiking CNN (LIF neurons, surrogate gradients, multi-step) on the bundled digits, in seed 000's shape.

sail launch -n 2 examples/snn_digits.py                      # 2 processes on this machine
sail launch -n 2 examples/snn_digits.py --epochs 5 --sail-config my.json

The engine finds the spikingjelly neurons and resets their state between batches; the config's
``snn`` section puts the network in multi-step mode (one call sees all T time steps), sets T and
the input encoding, and synchronises batch norm across the ranks over all T × N samples.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from spikingjelly.activation_based import layer, neuron, surrogate
from torch import nn

import spikingsail
from spikingsail.data.digits import load_digits_split
from spikingsail.snn import firing_rate

DEFAULT_CONFIG = Path(__file__).with_name("configs") / "snn_digits.json"


def spiking_cnn() -> nn.Module:
    def lif() -> nn.Module:
        return neuron.LIFNode(tau=2.0, surrogate_function=surrogate.ATan(), detach_reset=True)

    return nn.Sequential(
        layer.Conv2d(1, 16, 3, padding=1, bias=False),
        layer.BatchNorm2d(16),
        lif(),
        layer.MaxPool2d(2),  # 8×8 → 4×4
        layer.Conv2d(16, 32, 3, padding=1, bias=False),
        layer.BatchNorm2d(32),
        lif(),
        layer.MaxPool2d(2),  # → 2×2
        layer.Flatten(),
        layer.Linear(32 * 2 * 2, 10),
        lif(),
    )


def evaluate(engine: spikingsail.Engine, dataset: torch.utils.data.Dataset) -> float:
    """Accuracy over the whole test set: each rank scores its shard, then the counts are summed."""
    engine.eval()
    counts = torch.zeros(2)
    with torch.no_grad():
        for images, labels in engine.dataloader(dataset, shuffle=False, pad=False):
            # on engine.device, as the labels are
            predicted = firing_rate(engine(engine.encode(images))).argmax(dim=1)
            counts += torch.tensor([(predicted == labels).sum().item(), len(labels)])
    engine.train()
    correct, total = engine.all_reduce(counts).tolist()
    return correct / total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=15)
    parser = spikingsail.add_config_arguments(parser)
    args = parser.parse_args()
    if not (args.sail_config or args.deepspeed_config):
        args.sail_config = str(DEFAULT_CONFIG)

    train_set, test_set = load_digits_split()
    model = spiking_cnn()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.005)
    engine, optimizer = spikingsail.SpikingSail(args, model, optimizer).run()
    loader = engine.dataloader(train_set, shuffle=True)
    for epoch in range(loader.epoch, args.epochs):  # after a resume: the epoch the checkpoint was in
        for images, labels in loader:
            rate = firing_rate(engine(engine.encode(images)))  # [T, N, 10] spikes → [N, 10] rates
            loss = F.mse_loss(rate, F.one_hot(labels, 10).float())
            engine.backward(loss)
            engine.step()
        if engine.rank == 0 and (epoch + 1) % 5 == 0:
            print(f"epoch {epoch + 1}: loss {loss.item():.4f}", flush=True)
    accuracy = evaluate(engine, test_set)
    if engine.rank == 0:
        print(
            f"test accuracy: {accuracy:.4f} ({len(test_set)} images, {engine.world_size} processes)",
            flush=True,
        )
    engine.close()


if __name__ == "__main__":
    main()
