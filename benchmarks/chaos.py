"""Chaos: a job of two replica groups on the two-node namespace cluster, under a seeded stream of faults.

    python benchmarks/chaos.py                                  # 60 faults, seed 1, 540 epochs (~30 min each run)
    python benchmarks/chaos.py --faults 4 --epochs 6 --seed 3   # a short one
    python benchmarks/chaos.py --restart --faults 10 --epochs 25 --kinds kill-worker,stop-worker,cut-network
                                                                # restart from a checkpoint instead

The job is ``sail launch -H hostfile --ft-replicas 2`` over the cluster's two nodes (one group per
node, ssh launch), training ``tests/fault/replica_worker.py`` (a regression MLP, 12 steps of 8
samples per epoch, checkpoints every 6 steps of which each group keeps its last 2, ``--resume``) with
the engine's sample ledger on.
With ``--restart`` the job is one plain DDP process group over the two nodes instead (``sail launch
-H hostfile --max-restarts 1000``, no replica groups): a fault's "group" is then a rank, and a failed
worker makes torchrun restart every worker from the last checkpoint — the recovery most jobs have.
It runs twice in one invocation: fault-free, then with faults injected at seeded random moments
over the fault-free run's duration, each at a group chosen by the same seed:

- ``kill-worker``: SIGKILL the group's worker (its torchrun agent ends, sail launch starts the group again);
- ``stop-worker``: SIGSTOP it for 6 s (past the 3 s heartbeat timeout), then SIGCONT;
- ``cut-network``: drop every packet between the nodes for 5 s (iptables in node2's namespace);
- ``kill-agent``: SIGKILL the group's torchrun agent (its worker ends itself, the group is started again);
- ``full-disk``: fill the checkpoints' filesystem (a 32 MB tmpfs) for 8 s, across a save.

A fault aimed at a worker or agent waits for the group's worker to train (a group still starting,
or being started again, has none yet). Printed: faults injected (and those the job ended before),
whether the job survived them, goodput (committed steps per second ÷ the fault-free run's), the
steps taken again, samples lost and repeated (``sail report --ledger``), the steps whose samples
are not the fault-free run's (``--against``), processes left on the nodes, and how far the final
weights are from the fault-free run's. The suite runs a short seeded
version (``tests/cluster/test_chaos.py``) on its own cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from spikingsail.monitor import ledger_check  # noqa: E402
from tests.cluster.harness import NamespaceCluster  # noqa: E402

WORKER = ROOT / "tests" / "fault" / "replica_worker.py"
SAIL = [sys.executable, "-m", "spikingsail.cli.main", "launch"]
KINDS = ("kill-worker", "stop-worker", "cut-network", "kill-agent", "full-disk")
STEPS_PER_EPOCH = 12


@dataclass
class Fault:
    at: float
    """Seconds after the job started."""
    kind: str
    group: int
    when: float | None = None
    """The wall-clock time (``time.time()``) it was delivered, to set beside the ledger's records."""

    @property
    def delivered(self) -> bool:
        return self.when is not None


@dataclass
class Run:
    seconds: float
    returncode: int
    output: str
    out: Path
    faults: list[Fault] = field(default_factory=list)


def schedule(seed: int, count: int, seconds: float, kinds: tuple[str, ...]) -> list[Fault]:
    """``count`` faults at random moments of ``seconds`` (after a fifth of it, when both groups train),
    the kinds in turn (in a random order), each at a random group."""
    rng = random.Random(seed)
    times = sorted(rng.uniform(0.2 * seconds, 0.95 * seconds) for _ in range(count))
    order = rng.sample(kinds, len(kinds))
    return [Fault(t, order[i % len(order)], rng.randrange(2)) for i, t in enumerate(times)]


def live_worker(out: Path, group: int, by_rank: bool = False) -> int | None:
    """The pid of the group's newest live worker (its own record's name carries it); ``by_rank``:
    of rank ``group`` of a job without replica groups (its records say which rank wrote them)."""
    pattern = "ledger-0-*.jsonl" if by_rank else f"ledger-{group}-*.jsonl"
    for path in sorted(out.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True):
        pid = int(path.stem.rsplit("-", 1)[1])
        if by_rank and f'"rank": {group},' not in path.read_text().partition("\n")[0]:
            continue
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX":
                return pid
    return None


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def inject(
    fault: Fault, cluster: NamespaceCluster, out: Path, disk: Path | None, ended: threading.Event,
    by_rank: bool = False,
) -> None:  # fmt: skip
    """Deliver ``fault`` (and undo it after its time, for the ones that last). One aimed at a worker
    waits for the group's worker to train (a group being started again, or still starting, has none)
    until the job ends."""
    if fault.kind == "cut-network":
        iptables = ["ip", "netns", "exec", cluster.netns["node2"], "iptables"]
        rules = [["INPUT", "-s", cluster.address["node1"], "-j", "DROP"],
                 ["OUTPUT", "-d", cluster.address["node1"], "-j", "DROP"]]  # fmt: skip
        for rule in rules:
            subprocess.run([*iptables, "-A", *rule], check=True)
        fault.when = time.time()
        time.sleep(5)
        for rule in rules:
            subprocess.run([*iptables, "-D", *rule], check=True)
        return
    if fault.kind == "full-disk":
        if disk is None:
            return
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        filler = disk / "filler"
        with contextlib.suppress(OSError), filler.open("wb") as f:
            f.write(b"\0" * max(0, free - 4096))
        fault.when = time.time()
        time.sleep(8)
        filler.unlink(missing_ok=True)
        return
    while (worker := live_worker(out, fault.group, by_rank)) is None:
        if ended.wait(0.2):
            return
    with contextlib.suppress(ProcessLookupError, OSError):
        if fault.kind == "kill-worker":
            os.kill(worker, signal.SIGKILL)
        elif fault.kind == "kill-agent":
            os.kill(parent(worker), signal.SIGKILL)
        else:  # stop-worker
            os.kill(worker, signal.SIGSTOP)
            fault.when = time.time()
            time.sleep(6)
            os.kill(worker, signal.SIGCONT)
        if not fault.delivered:
            fault.when = time.time()


def run_job(cluster: NamespaceCluster, work: Path, name: str, epochs: int, faults: list[Fault],
            disk: Path | None, step_sleep: float, restart: bool = False) -> Run:  # fmt: skip
    """One job of two replica groups (``restart``: one process group) over the cluster's nodes,
    ``faults`` injected as scheduled."""
    out = work / name
    out.mkdir(parents=True)
    checkpoints = (disk or work) / f"ckpt-{name}"
    hostfile = work / "hostfile"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    groups = [] if restart else ["--ft-replicas", "2", "--ft-heartbeat-timeout", "3"]
    argv = [*SAIL, "-H", str(hostfile), "--ssh-config", str(cluster.ssh_config), *groups,
            "--max-restarts", "1000", str(WORKER), str(out), str(epochs),
            "--step-sleep", str(step_sleep), "--checkpoints", str(checkpoints), "--keep-last", "2", "--resume"]  # fmt: skip
    started = time.monotonic()
    job = subprocess.Popen(cluster.node_argv("node1", argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, cwd=work)  # fmt: skip
    output: list[str] = []
    ended = threading.Event()

    def read() -> None:
        output.append(job.communicate()[0])
        ended.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    for fault in faults:
        while time.monotonic() - started < fault.at and job.poll() is None:
            time.sleep(0.1)
        if job.poll() is not None:
            break
        threading.Thread(target=inject, args=(fault, cluster, out, disk, ended, restart), daemon=True).start()
    reader.join()
    seconds = time.monotonic() - started
    (out / "output.txt").write_text(output[0] if output else "")
    (out / "faults.json").write_text(json.dumps([asdict(f) for f in faults], indent=1))
    return Run(seconds, job.returncode, output[0] if output else "", out, faults)


def left_on_nodes(cluster: NamespaceCluster, within: float = 30) -> dict[int, str]:
    deadline = time.monotonic() + within
    while (found := cluster.job_processes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def weights_distance(a: Path, b: Path) -> tuple[float, bool]:
    """Max |a - b| over the final parameters of group 0, and whether they are bit-identical."""
    first, second = torch.load(a / "final-0.pt"), torch.load(b / "final-0.pt")
    distance = max(float((first[k] - second[k]).abs().max()) for k in first)
    return distance, all(torch.equal(first[k], second[k]) for k in first)


def chaos(cluster: NamespaceCluster, work: Path, *, seed: int, faults: int, epochs: int,
          kinds: tuple[str, ...], disk: Path | None = None, step_sleep: float = 0.25,
          restart: bool = False) -> dict[str, object]:  # fmt: skip
    """The fault-free run, then the faulty one; the numbers (see the module's text)."""
    free = run_job(cluster, work, "fault-free", epochs, [], disk, step_sleep, restart)
    if free.returncode != 0:
        raise SystemExit(f"the fault-free run failed:\n{free.output[-4000:]}")
    left_on_nodes(cluster)
    planned = schedule(seed, faults, free.seconds, kinds)
    faulty = run_job(cluster, work, "chaos", epochs, planned, disk, step_sleep, restart)
    left = left_on_nodes(cluster)
    ledger = ledger_check.resolve(faulty.out)
    unfaulted = ledger_check.resolve(free.out).steps
    other = [s for s, ids in ledger.steps.items() if sorted(ids) != sorted(unfaulted.get(s, []))]
    steps = epochs * STEPS_PER_EPOCH
    distance, identical = (
        weights_distance(faulty.out, free.out) if faulty.returncode == 0 else (float("nan"), False)
    )
    delivered = [f for f in planned if f.delivered]
    return {
        "faults injected": len(delivered),
        "faults the job ended before": len(planned) - len(delivered),
        "by kind": {k: sum(f.kind == k for f in delivered) for k in kinds},
        "job survived every fault": faulty.returncode == 0,
        "sail launch exit status": faulty.returncode,
        "fault-free seconds": round(free.seconds, 1),
        "chaos seconds": round(faulty.seconds, 1),
        "goodput": round((steps / faulty.seconds) / (steps / free.seconds), 3),
        "steps taken again": ledger.redone,
        "samples lost": ledger.lost,
        "samples repeated": ledger.repeated,
        "ledger problems": ledger.problems,
        "steps with other samples than the fault-free run's": len(other),
        "processes left on the nodes": len(left),
        "final weights max |chaos - fault-free|": distance,
        "final weights bit-identical": identical,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--faults", type=int, default=60)
    p.add_argument(
        "--epochs", type=int, default=540, help="of 12 steps (540: about 30 minutes fault-free on 2 cores)"
    )
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--restart", action="store_true",
                   help="one DDP process group restarted from its last checkpoint, not replica groups")  # fmt: skip
    p.add_argument("--keep", type=Path, metavar="DIR",
                   help="run in this new directory and keep it: each run's output, sample ledger and final weights")  # fmt: skip
    args = p.parse_args()
    kinds = tuple(args.kinds.split(","))
    unknown = set(kinds) - set(KINDS)
    if unknown:
        p.error(f"unknown fault kinds: {sorted(unknown)}")
    with contextlib.ExitStack() as stack:
        if args.keep is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sail-chaos-")))
        else:
            work = args.keep.resolve()
            work.mkdir(parents=True)  # a new directory: the runs' own, kept after the benchmark
        disk = work / "disk"
        disk.mkdir()
        # before the cluster starts: its nodes' mount namespaces are copies of this one
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)], check=True)
        cluster = NamespaceCluster(work / "cluster")
        try:
            cluster.start()
            found = chaos(cluster, work, seed=args.seed, faults=args.faults, epochs=args.epochs, kinds=kinds,
                          disk=disk, restart=args.restart)  # fmt: skip
        finally:
            cluster.stop()
            subprocess.run(["umount", "-l", str(disk)], check=False)
    width = max(len(k) for k in found)
    for key, value in found.items():
        print(f"{key:<{width}}  {value}")
    return 0 if found["job survived every fault"] and not found["ledger problems"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
