"""One matrix job: a small MLP on fixed data, trained for STEPS optimizer steps (or stopped on the way).

As a script (a replica group's process under ``sail launch --ft-replicas``)::

    python -m tests.matrix.job SPEC.json ACCUMULATION PHASE CHECKPOINTS|- OUT

saves its rank 0's result to ``OUT/result-GROUP.pt``."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.data.sampler import split_batch
from spikingsail.errors import SailError
from tests.device_copy import copying_device_moves
from tests.matrix.cells import RAGGED_LENGTH, SNN_TIME_STEPS, STEPS, STOP_STEP

MICRO = 4
"""Samples per rank and micro-step in the matrix's 2-rank jobs (``spec["micro"]`` when given)."""


def dataset(epoch: str = "whole") -> TensorDataset:
    """96 samples, or ``RAGGED_LENGTH`` (cells.EPOCHS)."""
    g = torch.Generator().manual_seed(11)
    length = RAGGED_LENGTH if epoch == "ragged" else 96
    return TensorDataset(torch.randn(length, 6, generator=g), torch.randint(0, 3, (length,), generator=g))


def config(spec: dict[str, Any], accumulation: int, checkpoints: str | None, phase: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec.get("micro", MICRO),
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": spec["stage"]},
        "sail": {"backend": spec["sail_backend"], "seed": 7, "progress_bar": False},
    }
    if spec["precision"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    ranks = int(os.environ.get("WORLD_SIZE", "1")) * int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    if spec["balance"] != "off" and ranks > 1:
        weights = [int(w) for w in spec["balance"].split(":")]
        cfg["sail"]["balance"] = weights[::-1] if checkpoints and phase == "resume" else weights
    if spec["model"] == "bn":
        cfg["snn"] = {"sync_batchnorm": True}
    if spec["model"] == "snn":
        chunk = 0 if spec.get("whole_time") else 2  # the reference runs whole
        cfg["snn"] = {"step_mode": "m", "time_steps": SNN_TIME_STEPS, "time_chunk": chunk}
    if "NUM_REPLICA_GROUPS" in os.environ:
        # every step needs both groups: a group that starts first would otherwise train a whole 6-step
        # job alone before the other arrives, and the cell would not test the groups training together
        cfg["fault_tolerance"] = {"min_replicas": int(os.environ["NUM_REPLICA_GROUPS"])}
    if spec.get("compile", "eager") != "eager":
        cfg["compile"] = {"enabled": True, "backend": spec["compile"]}
    if spec["scheduler"] == "config":
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                                           "warmup_num_steps": 4, "warmup_type": "linear"}}  # fmt: skip
    if spec["interruption"] == "sigkill" and checkpoints:
        cfg["checkpoint"] = {"path": checkpoints, "interval_steps": STOP_STEP}
    return cfg


def model(kind: str) -> torch.nn.Module:
    """The MLP, with batch norm before the tanh, with two more hidden layers of one shared weight, or
    with a multi-step LIF neuron in place of the tanh (cells.MODELS)."""
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))
    if kind == "tied":
        hidden = [torch.nn.Linear(24, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24), torch.nn.Tanh()]
        hidden[2].weight = hidden[0].weight
        return torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.Tanh(), *hidden, torch.nn.Linear(24, 3))
    if kind == "bn":
        return torch.nn.Sequential(
            torch.nn.Linear(6, 24), torch.nn.BatchNorm1d(24), torch.nn.Tanh(), torch.nn.Linear(24, 3)
        )
    from spikingjelly.activation_based import functional, layer, neuron, surrogate

    net = torch.nn.Sequential(
        layer.Linear(6, 24), neuron.LIFNode(tau=2.0, v_threshold=0.5, surrogate_function=surrogate.ATan(), detach_reset=True),
        layer.Linear(24, 3),
    )  # fmt: skip
    functional.set_step_mode(net, "m")
    return net


def whole(param: torch.Tensor) -> torch.Tensor:
    full = param.full_tensor() if isinstance(param, DTensor) else param
    return full.detach().float().cpu().clone()


def run(
    spec: dict[str, Any], accumulation: int, phase: str, checkpoints: str | None
) -> dict[str, Any] | None:
    """``phase``: "straight" (to the end), "first" (stop as the interruption says) or "resume".

    Every cell runs with a GPU's device-copy semantics (tests/device_copy.py), so that a collective
    path reading the tensor it moved instead of the one the collective wrote fails here too."""
    with copying_device_moves():
        return _run(spec, accumulation, phase, checkpoints)


def _run(
    spec: dict[str, Any], accumulation: int, phase: str, checkpoints: str | None
) -> dict[str, Any] | None:
    # "per-rank": each process its own initial weights, the global rank its seed (rank 0's is the reference's)
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    rank = group * int(os.environ.get("WORLD_SIZE", "1")) + int(os.environ.get("RANK", "0"))
    torch.manual_seed(rank if spec.get("init") == "per-rank" else 0)
    net = model(spec["model"])
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    scheduler = None
    if spec["scheduler"] == "client":
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    try:
        engine, _ = spikingsail.initialize(
            model=net, optimizer=optimizer, lr_scheduler=scheduler, config=config(spec, accumulation, checkpoints, phase),
            checkpoints_path=checkpoints, resume=phase == "resume",
        )  # fmt: skip
    except SailError as err:
        return {"refused": str(err)}
    stop = {"boundary": STOP_STEP * accumulation, "window": STOP_STEP * accumulation + 1,
            "sigkill": STOP_STEP * accumulation + 1, "world": STOP_STEP * accumulation}.get(spec["interruption"])  # fmt: skip
    loader = engine.dataloader(dataset(spec.get("epoch", "whole")))
    balance = engine.config.sail.balance
    micro = engine.config.train_micro_batch_size_per_gpu
    even = split_batch(micro * engine.world_size, list(balance))[engine.rank] if balance != "off" else micro
    participants = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))  # the fewest groups in a committed step
    while engine.global_steps < STEPS:
        for x, y in loader:
            share = even
            if engine.replicas is not None:  # the shares follow the groups taking part in the step
                share = loader.share[0]
            elif loader.share is not None and loader.share[1] < engine.train_batch_size():
                share = loader.share[0]  # the epoch's short step (its weights are checked at the end)
            assert len(x) == share, f"rank {engine.rank} got {len(x)} samples, its share is {share}"
            out = engine(engine.encode(x)).mean(0) if spec["model"] == "snn" else engine(x)
            engine.backward(F.cross_entropy(out.float(), y))
            steps = engine.global_steps
            engine.step()
            if engine.replicas is not None and engine.global_steps > steps:  # committed by the groups
                participants = min(participants, engine.replicas.manager.num_participants())
            if phase == "first" and engine.micro_steps == stop:
                if spec["interruption"] == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)  # the periodic save of step 3 is all there is
                try:
                    engine.save_checkpoint(str(checkpoints))
                except SailError as err:
                    engine.close()
                    return {"refused": str(err)}
                engine.close()
                return {"stopped": engine.global_steps}
            if engine.global_steps == STEPS:
                break
    # the parameters and the floating-point buffers (batch norm's running statistics)
    buffers = ((k, b) for k, b in engine.module.named_buffers() if b.is_floating_point())
    tensors = [*engine.module.named_parameters(), *buffers]
    result = {"params": {k: whole(v) for k, v in tensors}, "lr": engine.get_lr()[0], "steps": engine.global_steps,
              "participants": participants}  # fmt: skip
    engine.close()
    return result if engine.rank == 0 else None


def main() -> None:
    spec_path, accumulation, phase, checkpoints, out = sys.argv[1:]
    spec = json.loads(Path(spec_path).read_text())
    result = run(spec, int(accumulation), phase, None if checkpoints == "-" else checkpoints)
    if result is not None:
        torch.save(result, Path(out) / f"result-{os.environ.get('REPLICA_GROUP_ID', '0')}.pt")


if __name__ == "__main__":
    main()
