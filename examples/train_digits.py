"""The main job: a small CNN on scikit-learn's bundled digits images, trained with the engine API only.

sail launch -n 2 examples/train_digits.py                  # 2 processes on this machine
sail launch -n 2 examples/train_digits.py --epochs 5 --sail-config my.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import spikingsail
from spikingsail.data.digits import load_digits_split

DEFAULT_CONFIG = Path(__file__).with_name("configs") / "digits.json"


class DigitsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def evaluate(engine: spikingsail.Engine, dataset: torch.utils.data.Dataset) -> float:
    """Accuracy over the whole test set: each rank scores its shard, then the counts are summed."""
    engine.eval()
    counts = torch.zeros(2)
    with torch.no_grad():
        for images, labels in engine.dataloader(dataset, shuffle=False, pad=False):
            predicted = engine(images).argmax(dim=1)  # on engine.device, as the labels are
            counts += torch.tensor([(predicted == labels).sum().item(), len(labels)])
    engine.train()
    correct, total = engine.all_reduce(counts).tolist()
    return correct / total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser = spikingsail.add_config_arguments(parser)
    args = parser.parse_args()
    if not (args.sail_config or args.deepspeed_config):
        args.sail_config = str(DEFAULT_CONFIG)

    train_set, test_set = load_digits_split()
    engine, _ = spikingsail.SpikingSail(args, DigitsNet()).run()
    loader = engine.dataloader(train_set, shuffle=True)
    for epoch in range(loader.epoch, args.epochs):  # after a resume: the epoch the checkpoint was in
        for images, labels in loader:
            loss = F.cross_entropy(engine(images), labels)
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
