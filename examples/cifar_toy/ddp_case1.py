"""Seed 003's DDP script (``ddp_case1.py``), kept as its author wrote it, for comparison with
``train.py`` beside it (the same job on the engine). Few changes only, marked ``# changed:``
below: data from ``--data`` (no download), CPU + gloo where there is no GPU, ``--epochs`` and
``--lr``.

CUDA_VISIBLE_DEVICES="0,1" python -m torch.distributed.launch --nproc_per_node 2 ddp_case1.py --data DIR
torchrun --standalone --nproc-per-node 2 ddp_case1.py --data DIR
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm


### 1. 基础模块 ###
class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = self.fc3(x)
        return x


def cifar_or_folder(root, train, transform):
    # changed: CIFAR-10 where root holds it (torchvision's reader), else an ImageFolder's train/ or val/
    if os.path.isdir(os.path.join(root, "cifar-10-batches-py")):
        return torchvision.datasets.CIFAR10(root=root, train=train, download=False, transform=transform)
    return torchvision.datasets.ImageFolder(os.path.join(root, "train" if train else "val"), transform)


def get_dataset(root):
    transform = torchvision.transforms.Compose([
        torchvision.transforms.ToTensor(),
        torchvision.transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    ])
    my_trainset = cifar_or_folder(root, True, transform)  # changed: was CIFAR10(root='./data', download=True)
    # DDP：使用DistributedSampler
    train_sampler = torch.utils.data.distributed.DistributedSampler(my_trainset)
    # DDP：batch_size 是每个进程下的 batch_size
    trainloader = torch.utils.data.DataLoader(my_trainset, batch_size=16, num_workers=2, sampler=train_sampler)
    return trainloader


### 2. 初始化我们的模型、数据、各种配置  ####
parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", "--local-rank", default=int(os.environ.get("LOCAL_RANK", -1)), type=int)
parser.add_argument("--data", default="./data")  # changed
parser.add_argument("--epochs", default=100, type=int)  # changed
parser.add_argument("--lr", default=0.001, type=float)  # changed
FLAGS = parser.parse_args()
local_rank = FLAGS.local_rank

# DDP：DDP backend初始化
if torch.cuda.is_available():  # changed: the seed's two lines, or CPU + gloo where there is no GPU
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl')
    device = local_rank
else:
    dist.init_process_group(backend='gloo')
    device = "cpu"

# 准备数据，要在DDP初始化之后进行
trainloader = get_dataset(FLAGS.data)

# 构造模型
model = ToyModel().to(device)

# DDP: Load模型要在构造DDP模型之前，且只需要在master上加载就行了。
ckpt_path = None
if dist.get_rank() == 0 and ckpt_path is not None:
    model.load_state_dict(torch.load(ckpt_path))

# DDP: 构造DDP model
model = DDP(model, device_ids=[local_rank] if device != "cpu" else None,
            output_device=local_rank if device != "cpu" else None)

# DDP: 要在构造DDP model之后，才能用model初始化optimizer。
optimizer = torch.optim.SGD(model.parameters(), lr=FLAGS.lr)  # changed: lr=0.001

loss_func = nn.CrossEntropyLoss().to(device)

### 3. 网络训练  ###
model.train()
iterator = tqdm(range(FLAGS.epochs))
for epoch in iterator:
    # DDP：设置sampler的epoch
    trainloader.sampler.set_epoch(epoch)
    for data, label in trainloader:
        data, label = data.to(device), label.to(device)
        optimizer.zero_grad()
        prediction = model(data)
        loss = loss_func(prediction, label)
        loss.backward()
        iterator.desc = "loss = %0.3f" % loss
        optimizer.step()
    # DDP: 保存的是model.module，只需要在进程0上保存
    if dist.get_rank() == 0:
        torch.save(model.module.state_dict(), "%d.ckpt" % epoch)
dist.destroy_process_group()  # changed: added (a clean exit)
