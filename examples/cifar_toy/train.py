"""Seed 003's DDP toy job (``ddp_case1.py`` beside this file) on the engine API: the same model,
data, optimizer and batch size per process, with what the seed does by hand done by the engine.

    sail launch -n 2 examples/cifar_toy/train.py --data DIR            # this machine, 2 processes
    torchrun --standalone --nproc-per-node 2 examples/cifar_toy/train.py --data DIR
    sail launch -n 2 examples/cifar_toy/train.py --data DIR --resume   # continue from ./checkpoints

DIR holds CIFAR-10 (``cifar-10-batches-py``, read by torchvision) or an ImageFolder (``train/``,
``val/``); ``python -m spikingsail.data.digits DIR`` writes the bundled digits as one.

What changed against the seed's script: no ``--local_rank``, ``init_process_group``,
``set_device``, ``DistributedSampler`` / ``set_epoch``, ``DDP(...)`` or ``.to(local_rank)``: the
engine does them, for any launcher and backend (``--sail-config``); the rank-0
``torch.save(model.module.state_dict())`` is ``engine.save_model`` (any backend: FSDP shards and ZeRO
partitions gathered); every epoch is also a checkpoint that ``--resume`` continues exactly.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import spikingsail


class ToyModel(nn.Module):  # seed 003's, unchanged
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def cifar_or_folder(root: str, train: bool) -> torch.utils.data.Dataset:
    transform = torchvision.transforms.Compose([
        torchvision.transforms.ToTensor(),
        torchvision.transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    ])  # fmt: skip
    if os.path.isdir(os.path.join(root, "cifar-10-batches-py")):
        return torchvision.datasets.CIFAR10(root=root, train=train, download=False, transform=transform)
    return torchvision.datasets.ImageFolder(os.path.join(root, "train" if train else "val"), transform)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default="./data")
    parser.add_argument("--epochs", default=100, type=int)
    parser.add_argument("--lr", default=0.001, type=float)
    parser.add_argument("--out", default="toy.safetensors", help="the trained model (.safetensors or .pt)")
    parser = spikingsail.add_config_arguments(parser)  # --sail-config, --checkpoints-path, --resume
    args = parser.parse_args()
    args.checkpoints_path = args.checkpoints_path or "./checkpoints"
    # the seed's batch of 16 per process, unless --sail-config gives a config
    config = None if args.sail_config or args.deepspeed_config else {"train_micro_batch_size_per_gpu": 16}

    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    engine, optimizer = spikingsail.SpikingSail(args, model, optimizer, config=config).run()
    loader = engine.dataloader(cifar_or_folder(args.data, train=True), shuffle=True, num_workers=2)
    for _epoch in range(loader.epoch, args.epochs):  # after --resume: the epoch the checkpoint was in
        for data, label in loader:  # on engine.device already
            loss = F.cross_entropy(engine(data), label)
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(args.checkpoints_path)  # every epoch, as seed 003 saves
    engine.eval()
    counts = torch.zeros(2)
    with torch.no_grad():
        for data, label in engine.dataloader(
            cifar_or_folder(args.data, train=False), shuffle=False, pad=False
        ):
            counts += torch.tensor([(engine(data).argmax(1) == label).sum().item(), len(label)])
    correct, total = engine.all_reduce(counts).tolist()
    engine.save_model(args.out)
    if engine.rank == 0:
        print(f"val accuracy: {correct / total:.4f} ({int(total)} images, {engine.world_size} processes); "
              f"model: {args.out}", flush=True)  # fmt: skip
    engine.close()


if __name__ == "__main__":
    main()
