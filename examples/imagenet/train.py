"""Seed 002's elastic ImageNet trainer on the engine API: conventional (torchvision) and spiking
(spikingjelly, multi-step over T time steps) networks, started the three ways seed 002 shows.

One machine (torchrun, or sail launch):
    torchrun --standalone --nnodes=1 --nproc-per-node=4 examples/imagenet/train.py DATA \\
        --epochs=30 --resume --checkpoints-path=./checkpoints
    sail launch -n 4 examples/imagenet/train.py DATA --epochs=30 --resume --checkpoints-path=./checkpoints

SLURM, one task per process (--dist-init-method slurm: rank = SLURM_PROCID, world = SLURM_NTASKS,
master = the first node of the step, port = --master-port):
    srun -N 2 --ntasks-per-node=4 --gpus-per-task=1 python examples/imagenet/train.py DATA \\
        --val-path VAL --dist-init-method slurm --checkpoints-path=./checkpoints --epochs=30 --resume
    sail submit -N 2 --gpus-per-node 4 --dist-init-method slurm examples/imagenet/train.py DATA ...

SLURM, one torchrun per node (seed 002's sbatch script: srun torchrun --rdzv-backend=c10d ...), or
    sail submit -N 2 --gpus-per-node 4 examples/imagenet/train.py DATA ...

DATA is an ImageFolder (``DATA/train/<class>/*`` or ``DATA/<class>/*``); validation reads
``--val-path`` (``VAL/val`` or ``VAL``), by default ``DATA/val`` when it exists.
``python -m spikingsail.data.digits DIR`` writes the bundled digits in this layout (no download).

A SLURM task given several GPUs (seed 002's ``--ntasks-per-node=1 --gpus-per-task=2``) is still one
process, on one GPU: the others would idle, so the trainer refuses and says what to write instead.
Precision, backend and ZeRO come from ``--sail-config`` (DeepSpeed-format JSON); ``--batch-size``
is per process, as in torchelastic's ImageNet example that seed 002 runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision import transforms

import spikingsail
from spikingsail.errors import SailError
from spikingsail.snn import firing_rate

SPIKING = ("sew_resnet", "spiking_resnet", "spiking_vgg")
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "data", metavar="DATA", help="ImageFolder: DATA/train/<class>/... or DATA/<class>/..."
    )
    parser.add_argument(
        "--val-path", "--val_path", dest="val_path", help="validation ImageFolder (VAL/val or VAL)"
    )
    parser.add_argument("--arch", default="resnet18",
                        help="torchvision's name (resnet18, resnet50, ...) or spikingjelly's "
                             "(sew_resnet18, spiking_resnet18, spiking_vgg11_bn, ...)")  # fmt: skip
    parser.add_argument("--T", type=int, default=4, help="time steps of a spiking network")
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument(
        "--batch-size", "--batch_size", dest="batch_size", type=int, help="per process (default 32)"
    )
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", "--weight_decay", dest="weight_decay", type=float, default=1e-4)
    parser.add_argument("--workers", "-j", type=int, default=4, help="data loading processes per rank")
    parser.add_argument(
        "--image-size", type=int, default=224, help="training crop (validation: resize 8/7, crop)"
    )
    parser.add_argument("--min-crop", type=float, default=0.08, help="RandomResizedCrop's smallest area")
    parser.add_argument(
        "--no-flip",
        dest="flip",
        action="store_false",
        help="no random horizontal flips (for data where a mirror changes the class)",
    )
    parser.add_argument("--dist-init-method", "--dist_init_method", dest="dist_init_method",
                        choices=("env", "slurm"), default="env",
                        help="env: the launcher's variables (torchrun, a platform's MASTER_ADDR/RANK/"
                             "WORLD_SIZE); slurm: one rank per srun task")  # fmt: skip
    parser.add_argument("--master-port", "--master_port", dest="master_port", type=int,
                        help="with --dist-init-method slurm (default: derived from the job id)")  # fmt: skip
    parser.add_argument("--out", default="model.safetensors", help="the trained model, written at the end")
    parser = spikingsail.add_config_arguments(parser)  # --sail-config, --checkpoints-path, --resume
    args = parser.parse_args()
    args.checkpoints_path = args.checkpoints_path or "./checkpoints"
    try:  # mistakes in the flags end here, with argparse's usage line, before any work
        check_arch(args.arch)
        if args.dist_init_method == "slurm":
            use_slurm_tasks(args)
    except SailError as err:
        parser.error(str(err))
    return args


def spiking(arch: str) -> bool:
    return arch.startswith(SPIKING)


def build_model(arch: str, num_classes: int) -> nn.Module:
    """torchvision's ``arch``, or spikingjelly's with IF neurons and ATan surrogate gradients."""
    if spiking(arch):
        from spikingjelly.activation_based import neuron, surrogate

        family, factory = spiking_factory(arch)
        if factory is not None:
            extra: dict[str, Any] = {"cnf": "ADD"} if family == "sew_resnet" else {}
            return factory(num_classes=num_classes, spiking_neuron=neuron.IFNode,
                           surrogate_function=surrogate.ATan(), detach_reset=True, **extra)  # fmt: skip
    elif arch in torchvision.models.list_models(module=torchvision.models):
        return torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    raise unknown_arch(arch)


def spiking_factory(arch: str) -> tuple[str, Any]:
    """spikingjelly's constructor for ``arch`` (its module's name, the function), or ("", None)."""
    from spikingjelly.activation_based.model import sew_resnet, spiking_resnet, spiking_vgg

    for family in (sew_resnet, spiking_resnet, spiking_vgg):
        factory = getattr(family, arch, None)
        if callable(factory) and not arch.startswith("_"):
            return family.__name__.rsplit(".", 1)[-1], factory
    return "", None


def check_arch(arch: str) -> None:
    if spiking(arch):
        known = spiking_factory(arch)[1] is not None
    else:
        known = arch in torchvision.models.list_models(module=torchvision.models)
    if not known:
        raise unknown_arch(arch)


def unknown_arch(arch: str) -> SailError:
    return SailError(
        f"--arch {arch}: no such network",
        "it is neither a torchvision classification model nor a spikingjelly "
        "sew_resnet / spiking_resnet / spiking_vgg",
        "e.g. --arch resnet18, resnet50, sew_resnet18, spiking_resnet18, spiking_vgg11_bn",
    )


def image_folder(path: str, split: str, transform: Any) -> torchvision.datasets.ImageFolder:
    root = Path(path) / split if (Path(path) / split).is_dir() else Path(path)
    if not root.is_dir():
        raise SailError(f"{root}: no such directory", fix="give an ImageFolder: <dir>/<class>/<image>")
    return torchvision.datasets.ImageFolder(str(root), transform)


def datasets(args: argparse.Namespace) -> tuple[Any, Any]:
    size = args.image_size
    flip = [transforms.RandomHorizontalFlip()] if args.flip else []
    train = image_folder(args.data, "train", transforms.Compose([
        transforms.RandomResizedCrop(size, scale=(args.min_crop, 1.0)), *flip,
        transforms.ToTensor(), transforms.Normalize(MEAN, STD),
    ]))  # fmt: skip
    val_root = args.val_path or (os.path.join(args.data, "val") if Path(args.data, "val").is_dir() else None)
    val = None
    if val_root is not None:
        val = image_folder(val_root, "val", transforms.Compose([
            transforms.Resize(size * 8 // 7), transforms.CenterCrop(size),
            transforms.ToTensor(), transforms.Normalize(MEAN, STD),
        ]))  # fmt: skip
    return train, val


def config(args: argparse.Namespace) -> dict[str, Any]:
    """The config file's settings, with --batch-size and, for a spiking network, multi-step over T."""
    path = args.sail_config or args.deepspeed_config
    cfg: dict[str, Any] = json.loads(Path(path).read_text()) if path else {}
    args.sail_config = args.deepspeed_config = None  # handed over as a dict below
    if args.batch_size or "train_micro_batch_size_per_gpu" not in cfg:
        cfg["train_micro_batch_size_per_gpu"] = args.batch_size or 32
        cfg.pop("train_batch_size", None)
    if spiking(args.arch):
        cfg["snn"] = {"step_mode": "m", "time_steps": args.T, "encoding": "repeat", **cfg.get("snn", {})}
    cfg.setdefault("sail", {}).setdefault("progress_bar", True)
    return cfg


def use_slurm_tasks(args: argparse.Namespace) -> None:
    """--dist-init-method slurm: this process is one srun task, one rank."""
    if "SLURM_STEP_ID" not in os.environ:
        raise SailError("--dist-init-method slurm: this process was not started by srun (no SLURM_STEP_ID)",
                        "the ranks are read from the srun task's SLURM_PROCID and SLURM_NTASKS",
                        "start it with srun, or drop --dist-init-method slurm under torchrun")  # fmt: skip
    slurm = {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID"}
    for var, own in slurm.items():  # sail submit's srun shim exports SLURM's values under these names
        if var in os.environ and os.environ[var] != os.environ.get(own):
            raise SailError(
                f"--dist-init-method slurm, but {var}={os.environ[var]} (set by torchrun or the environment) "
                f"contradicts {own}={os.environ.get(own)}",
                "each srun task is one rank; torchrun's ranks would contradict SLURM's",
                "under srun torchrun use --dist-init-method env (the default)",
            )
    visible = torch.cuda.device_count()
    if visible > 1:
        tasks = os.environ.get("SLURM_NTASKS_PER_NODE", "1")
        raise SailError(f"--dist-init-method slurm: this task sees {visible} GPUs but is one process",
                        "one rank drives one GPU; the other GPUs of the task would idle",
                        f"give each GPU its own task (srun --ntasks-per-node={visible * int(tasks)} "
                        "--gpus-per-task=1), or start one torchrun per node as seed 002's sbatch script "
                        "does (srun torchrun --nproc-per-node=GPUS ...)")  # fmt: skip
    if args.master_port:
        os.environ["MASTER_PORT"] = str(args.master_port)


def top_k_counts(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
    hits = top5 == labels[:, None]
    return torch.tensor(
        [hits[:, 0].sum().item(), hits.any(dim=1).sum().item(), len(labels)], dtype=torch.float64
    )


def main() -> None:
    args = parse_args()
    train_set, val_set = datasets(args)
    model = build_model(args.arch, len(train_set.classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)  # fmt: skip
    engine, optimizer = spikingsail.SpikingSail(args, model, optimizer, config=config(args)).run()
    snn = spiking(args.arch)

    def logits(images: torch.Tensor) -> torch.Tensor:
        out = engine(engine.encode(images) if snn else images)
        return firing_rate(out) if snn else out  # [T, N, classes] → mean over T

    loader = engine.dataloader(
        train_set, shuffle=True, num_workers=args.workers, persistent_workers=args.workers > 0
    )
    for group in optimizer.param_groups:
        group["lr"] = cosine_lr(args, loader.epoch)
    for epoch in range(loader.epoch, args.epochs):
        for images, labels in loader:
            loss = F.cross_entropy(logits(images).float(), labels)
            engine.backward(loss)
            engine.step()
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(args, epoch + 1)
        engine.save_checkpoint(args.checkpoints_path)  # every epoch; --resume continues from the latest
        if val_set is not None:
            top1, top5 = validate(engine, val_set, logits, args.workers)
            if engine.rank == 0:
                print(f"epoch {epoch + 1}/{args.epochs}: loss {loss.item():.4f} val top-1 {top1:.4f} "
                      f"top-5 {top5:.4f}", flush=True)  # fmt: skip
    if val_set is not None:
        top1, top5 = validate(engine, val_set, logits, args.workers)
        if engine.rank == 0:
            print(f"final: val top-1 {top1:.4f} top-5 {top5:.4f} ({len(val_set)} images, "
                  f"{engine.world_size} processes, {args.arch})", flush=True)  # fmt: skip
    engine.save_model(args.out)
    engine.close()


def cosine_lr(args: argparse.Namespace, epoch: int) -> float:
    """The learning rate at the start of ``epoch``: cosine from --lr to 0 over the epochs (a function
    of the epoch alone, so a resumed run continues the same curve)."""
    factor = 0.5 * (1 + math.cos(math.pi * min(epoch, args.epochs) / max(args.epochs, 1)))
    return args.lr * factor


def validate(engine: spikingsail.Engine, dataset: Any, logits: Any, workers: int) -> tuple[float, float]:
    """Top-1 and top-5 accuracy over the whole validation set: each rank scores its part (no sample
    twice), then the counts are summed over the ranks."""
    engine.eval()
    counts = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for images, labels in engine.dataloader(dataset, shuffle=False, pad=False, num_workers=workers):
            counts += top_k_counts(logits(images).float().cpu(), labels.cpu())
    engine.train()
    top1, top5, total = engine.all_reduce(counts).tolist()
    return top1 / total, top5 / total


if __name__ == "__main__":
    main()
