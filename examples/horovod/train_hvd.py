"""Seed 001's Horovod migration, as a whole script: ``hvd.init``, a DistributedSampler over
``hvd.size()`` ranks, ``hvd.DistributedOptimizer`` (fp16 compression, Adasum,
``backward_passes_per_step``), and the broadcast of parameters and optimizer state. Its model and
data are the bundled digits (the seed migrates SwAV; the Horovod parts do not depend on the model).
``train.py`` beside it is the same job on the engine with ``sail.backend: horovod``.

    horovodrun -np 2 -H localhost:2 python examples/horovod/train_hvd.py
    horovodrun -np 4 -H IP1:2,IP2:2 python examples/horovod/train_hvd.py --fp16-allreduce
    sail launch --launcher horovodrun -n 2 examples/horovod/train_hvd.py
"""

import argparse

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

from spikingsail.data.digits import load_digits_split

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--base-lr", type=float, default=0.01)
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16 for the all-reduce")
parser.add_argument("--use-adasum", action="store_true", help="Adasum instead of averaging (needs MPI)")
parser.add_argument("--batches-per-allreduce", type=int, default=1, help="backward passes per all-reduce")
args = parser.parse_args()

hvd.init()
if torch.cuda.is_available():
    torch.cuda.set_device(hvd.local_rank())
device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
torch.manual_seed(0)

train_dataset, test_dataset = load_digits_split()
sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
train_loader = torch.utils.data.DataLoader(
    train_dataset,
    sampler=sampler,
    batch_size=args.batch_size,
    num_workers=args.workers,
    pin_memory=torch.cuda.is_available(),
    drop_last=True,
)

model = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
).to(device)
# Horovod: scale the learning rate by the number of ranks (Adasum: by the local ranks on GPUs, else 1).
lr_scaler = hvd.size() if not args.use_adasum else 1
optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr * lr_scaler, momentum=0.9)
# Horovod: (optional) compression algorithm.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
# Horovod: wrap optimizer with DistributedOptimizer.
optimizer = hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(),
    compression=compression,
    backward_passes_per_step=args.batches_per_allreduce,
    op=hvd.Adasum if args.use_adasum else hvd.Average)
# Horovod: broadcast parameters & optimizer state.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        if batch_idx % args.batches_per_allreduce == 0:
            optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target) / args.batches_per_allreduce
        loss.backward()
        if (batch_idx + 1) % args.batches_per_allreduce == 0:
            optimizer.step()

# Every rank scores its part of the test set; hvd.allreduce sums the counts.
model.eval()
part = torch.utils.data.Subset(test_dataset, range(hvd.rank(), len(test_dataset), hvd.size()))
correct = total = 0
with torch.no_grad():
    for data, target in torch.utils.data.DataLoader(part, batch_size=256):
        correct += (model(data.to(device)).argmax(1).cpu() == target).sum().item()
        total += len(target)
counts = hvd.allreduce(torch.tensor([correct, total], dtype=torch.float64), op=hvd.Sum)
if hvd.rank() == 0:
    print(f"test accuracy: {counts[0] / counts[1]:.4f} ({int(counts[1])} images, {hvd.size()} processes)", flush=True)
