"""Seed 000's script shape, unchanged: DeepSpeed-style flags, ``SpikingSail(args, model, optimizer).run()``,
and a model whose forward takes the batch and returns the loss.

    sail launch -n 2 examples/seed000/train.py --deepspeed --deepspeed_config examples/seed000/ds_config.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import spikingsail
from spikingsail.data.digits import load_digits_split


class ClassifierWithLoss(nn.Module):
    """Returns the loss of a batch, as DeepSpeed examples' models often do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.net(images), labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser = spikingsail.add_config_arguments(parser)
    args = parser.parse_args()

    model = ClassifierWithLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model_engine, optimizer = spikingsail.SpikingSail(args, model, optimizer).run()

    train_set, _ = load_digits_split()
    data_loader = model_engine.dataloader(train_set)
    for _epoch in range(args.epochs):
        for _step, batch in enumerate(data_loader):
            # forward() method
            loss = model_engine(batch)
            # runs backpropagation
            model_engine.backward(loss)
            # weight update
            model_engine.step()
    if model_engine.rank == 0:
        print(
            f"finished {model_engine.global_steps} steps, last loss {loss.item():.4f}, "
            f"loss scale {model_engine.loss_scale:g}",
            flush=True,
        )
    model_engine.close()


if __name__ == "__main__":
    main()
