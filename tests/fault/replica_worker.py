"""A training script for the replica-group tests: a small regression model on a fixed data set.

    python replica_worker.py OUT EPOCHS [--kill-group G --kill-step S --kill-in between|allreduce|commit]
    python replica_worker.py OUT EPOCHS --reference R   (one process, the global batch of R ranks)
    python replica_worker.py OUT EPOCHS --checkpoints DIR [--resume] [--keep-last K]   (saves every 6 steps)

Writes OUT/final-GROUP.pt (the parameters at the end) and OUT/ledger-GROUP-PID.jsonl (step, sample
ids of each committed batch; with other groups in the step's quorum, a ``taking`` line before its
gradients leave, as the engine's ledger writes). With --kill-*, group G's process SIGKILLs itself the first time it
reaches step S with every group taking part (a marker file keeps the restarted one alive): between
two steps, or as it enters its gradient all-reduce across the groups (its peers, in the same
quorum, wait in theirs; had it sent its share first, the peers could finish the step without it). With
--fail-heal-rank R, rank R's first heal fails; with --perturb-group G, group G's parameters differ by
one float32 step when it joins the others. With --stop-group G --stop-step S, group G's process
SIGSTOPs itself there instead, once it has recorded a step of its own in a quorum of every group (a
group that joined late takes one first; OUT/stopped-G holds its pid; whoever started it continues it).
With --hold-group G, group G's process joins the job only once OUT/go-G exists. While OUT/pause-G
exists, group G's process waits between two steps (OUT/paused-G says it does), its torchft manager
still heartbeating.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import IO, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.environments import RankInfo

MICRO, SAMPLES = 4, 96


def write_taking(ledger: IO[str], engine: Any, step: int, ids: list[int], group: int) -> None:
    """Before the step's gradients go to the other groups: what it takes (the other groups may
    commit it with them after this process is killed, before it writes the step)."""
    manager = engine.replicas.manager if engine.replicas is not None else None
    if manager is not None and manager.num_participants() > 1:
        entry = {"taking": step, "ids": ids, "quorum": manager._quorum_id, "group": group, "pid": os.getpid()}
        ledger.write(json.dumps(entry) + "\n")
        ledger.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("epochs", type=int)
    parser.add_argument("--kill-group", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--kill-in", choices=["between", "allreduce", "commit"], default="between")
    parser.add_argument("--stop-group", type=int, default=-1)
    parser.add_argument("--stop-step", type=int, default=-1)
    parser.add_argument(
        "--kill-rank",
        type=int,
        default=-1,
        help="only this rank of the group (default: the first to get there)",
    )
    parser.add_argument(
        "--fail-heal-rank",
        type=int,
        default=-1,
        help="this rank's first heal fails as if its peer went away mid-transfer",
    )
    parser.add_argument(
        "--perturb-group",
        type=int,
        default=-1,
        help="this group's parameters are nudged just before it first joins the others",
    )
    parser.add_argument(
        "--hold-group",
        type=int,
        default=-1,
        help="this group's process waits for OUT/go-G before it joins the job (its imports done)",
    )
    parser.add_argument("--min-replicas", type=int, default=1, help="fault_tolerance.min_replicas")
    parser.add_argument("--backend", default="ddp", help="sail.backend (fsdp: sharded within each group)")
    parser.add_argument("--hidden", type=int, default=16, help="width of the hidden layer")
    parser.add_argument(
        "--reference",
        type=int,
        default=0,
        metavar="RANKS",
        help="one process taking the micro-batches of RANKS ranks at once",
    )
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds added to every step")
    parser.add_argument("--checkpoints", help="save every 6 steps here; with --resume, continue from there")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--keep-last", type=int, default=0, help="checkpoint.keep_last (0: every checkpoint)")
    args = parser.parse_args()
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    if args.fail_heal_rank >= 0 and int(os.environ.get("RANK", "0")) == args.fail_heal_rank:
        fail_first_heal(args.out / f"heal-failed-{group}")
    if group == args.perturb_group:
        perturb_before_joining()
    while group == args.hold_group and not (args.out / f"go-{group}").exists():
        time.sleep(0.05)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1))
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO * (args.reference or 1),
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "sail": {
            "seed": 1,
            "progress_bar": False,
            "hang_timeout_seconds": 0,
            "straggler_window": 0,
            "backend": args.backend,
            "ledger": True,  # the engine's own, checked against this script's
            "log_dir": str(args.out),
        },
        "fault_tolerance": {
            "timeout_seconds": 3,
            "quorum_timeout_seconds": 60,
            "min_replicas": args.min_replicas,
        },
        "checkpoint": {"interval_steps": 6, "keep_last": args.keep_last},
    }
    engine, _ = spikingsail.initialize(
        model=model, config=config, rank_info=RankInfo.single() if args.reference else None,
        checkpoints_path=args.checkpoints, resume=args.resume,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(5)
    ids = torch.arange(SAMPLES, dtype=torch.float32).unsqueeze(1)
    data = TensorDataset(
        torch.randn(SAMPLES, 8, generator=generator), torch.randn(SAMPLES, 1, generator=generator), ids
    )
    loader = engine.dataloader(data)
    marker = args.out / f"killed-{group}"
    ledger = (args.out / f"ledger-{group}-{os.getpid()}.jsonl").open("a")
    committed = False  # this process has recorded a step
    for _epoch in range(loader.epoch, args.epochs):
        for x, y, sample_ids in loader:
            step = engine.global_steps
            pause = args.out / f"pause-{group}"
            while pause.exists():
                (args.out / f"paused-{group}").touch()
                time.sleep(0.05)
            chosen = args.kill_rank < 0 or engine.rank == args.kill_rank
            if (
                group == args.kill_group
                and chosen
                and step >= args.kill_step
                and not marker.exists()
                and (engine.replicas is None or engine.replicas.manager.num_participants() == groups)
            ):  # the kill must find a peer (plain DDP: the other rank)
                marker.write_text(f"{time.time()}")
                if args.kill_in == "between":
                    os.kill(os.getpid(), signal.SIGKILL)
                kill_in_first(engine, "allreduce" if args.kill_in == "allreduce" else "should_commit")
            stopped = args.out / f"stopped-{group}"
            if (
                group == args.stop_group
                and step >= args.stop_step
                and not stopped.exists()
                and committed  # a group that joined late (healed past the step) takes one first
                and (engine.replicas is None or engine.replicas.manager.num_participants() == groups)
            ):  # stopped in step with its peer, after steps the others saw it take
                stopped.write_text(f"{os.getpid()}")
                os.kill(os.getpid(), signal.SIGSTOP)
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            write_taking(ledger, engine, step, sample_ids.flatten().int().tolist(), group)
            engine.step()
            if engine.global_steps > step:  # committed; written at once, before a kill can come
                digest = sum(float(full(p).double().sum()) for p in model.parameters())
                manager = engine.replicas.manager if engine.replicas is not None else None
                quorum = manager._quorum_id if manager is not None else None
                lighthouse = manager._client.lighthouse_id if manager is not None else None
                alone = manager is None or manager.num_participants() == 1
                entry = {"step": step, "ids": sample_ids.flatten().int().tolist(), "digest": digest,
                         "time": time.time(), "rank": engine.rank, "quorum": quorum, "alone": alone,
                         "lighthouse": lighthouse, "group": group, "pid": os.getpid(),
                         "attempt": os.environ.get("TORCHELASTIC_RESTART_COUNT")}  # fmt: skip
                ledger.write(json.dumps(entry) + "\n")
                ledger.flush()
                committed = True
            time.sleep(args.step_sleep)
    from torch.distributed.tensor import DTensor

    final = {k: full(v).clone() for k, v in model.state_dict().items()}  # fsdp: a collective
    if engine.rank == 0:
        torch.save(final, args.out / f"final-{group}.pt")
        if any(isinstance(p, DTensor) for p in model.parameters()):
            (args.out / f"sharded-{group}").write_text(f"{engine.world_size}")
        (args.out / f"steps-{group}").write_text(f"{engine.global_steps} {groups}")
    engine.close()


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's (FSDP's shards, gathered from the group's ranks) or the tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.detach().full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


def kill_in_first(engine: Any, call: str) -> None:
    """SIGKILL as the process enters torchft's ``allreduce`` (before its gradients leave) or its
    ``should_commit`` (after they reached the other groups, which then commit the step without it)."""

    def die(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(engine.replicas.manager, call, die)


def perturb_before_joining() -> None:
    """One parameter one float32 step up, after a resume and before the first quorum: at the same step
    as the other groups, with a different state."""
    from spikingsail.engine.engine import Engine

    original = Engine.join_replica_groups

    def join(self: Engine) -> None:
        with torch.no_grad():
            weight = next(self.module.parameters())
            weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(float("inf")))
        original(self)

    Engine.join_replica_groups = join  # type: ignore[method-assign]


def fail_first_heal(marker: Path) -> None:
    """The first checkpoint this process fetches from a live group fails (once per group)."""
    from spikingsail.engine.replica_transport import SignedStateTransport

    original = SignedStateTransport.recv_checkpoint

    def recv_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not marker.exists():
            marker.write_text(f"{time.time()}")
            raise ConnectionResetError("the live group's rank went away mid-transfer (injected)")
        return original(self, *args, **kwargs)

    SignedStateTransport.recv_checkpoint = recv_checkpoint  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
