"""``sail submit``: write an sbatch script like seed 002's, submit it, optionally wait for it.

The script's srun line comes from the same builders ``sail launch`` uses inside an allocation, with
the allocation's values left to the shell (``$SLURM_NNODES``, ``$SLURM_JOB_ID``, the first host
from ``scontrol show hostnames``, the rendezvous port from ``slurm_port``). Those are the only words
the shell expands (``ShellWord``); every other word, the user's arguments above all, is quoted with
``shlex.quote`` and reaches the job exactly as typed.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from spikingsail.errors import LaunchError
from spikingsail.exits import PREEMPTED_EXIT_CODE
from spikingsail.launchers.command import FORWARDED_SIGNALS
from spikingsail.launchers.hostfile import MAX_SLOTS
from spikingsail.launchers.slurm import DIST_INIT_METHODS, task_step, torchrun_step
from spikingsail.launchers.spec import LaunchRequest, check_counts, check_port, in_range

log = logging.getLogger(__name__)


# sbatch options that change a job's size (the later #SBATCH line wins)
_SIZE_ARGS = ("-N", "--nodes", "-n", "--ntasks")
MAX_NODES = 100_000
"""More nodes than any SLURM cluster has; a larger count is a typo."""
MAX_CPUS = 65_536
"""More CPUs than any node has."""
MAX_SIGNAL_TIME = 65_535
"""The most seconds SLURM's ``--signal=B:USR1@T`` takes (sbatch's manual: T from 0 to 65535)."""


class ShellWord(str):
    """A word of the script that the shell expands: a variable of the allocation, written by
    ``sail submit`` itself, never a user's argument."""

    __slots__ = ()


@dataclass(kw_only=True, slots=True, frozen=True)
class SubmitRequest:
    script: str
    script_args: list[str]
    job_name: str
    nodes: int
    gpus_per_node: int | None
    nproc_per_node: int
    dist_init_method: str
    cpus_per_task: int | None = None
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    output: str | None = None
    error: str | None = None
    extra_sbatch: list[str] = field(default_factory=list)
    torchrun_args: list[str] = field(default_factory=list)
    master_port: int | None = None
    """None: derived from the job id in the script (``slurm_port``)."""
    workdir: str = field(default_factory=os.getcwd)
    requeue: bool = False
    signal_before: int = 120

    @property
    def world_size(self) -> int | None:
        """The job's processes, unless an --sbatch-arg changes the nodes or tasks the flags ask for."""
        if any(arg.startswith(_SIZE_ARGS) for arg in self.extra_sbatch):
            return None
        return self.nodes * self.nproc_per_node

    def directives(self) -> list[str]:
        torchrun = self.dist_init_method == "torchrun"
        tasks_per_node = 1 if torchrun else self.nproc_per_node
        pairs: list[tuple[str, object]] = [
            ("job-name", self.job_name),
            ("nodes", self.nodes),
            ("ntasks-per-node", tasks_per_node),
            ("gpus-per-task", (self.gpus_per_node if torchrun else 1) if self.gpus_per_node else None),
            ("cpus-per-task", self.cpus_per_task),
            ("partition", self.partition),
            ("time", self.time),
            ("account", self.account),
            ("output", self.output or f"{self.job_name}-%j.out"),
            ("error", self.error),
        ]
        if self.requeue:
            pairs += [("signal", f"B:USR1@{self.signal_before}"), ("open-mode", "append")]
        lines = [f"#SBATCH --{key}={value}" for key, value in pairs if value is not None]
        if self.requeue:
            lines.append("#SBATCH --requeue")
        return lines + [f"#SBATCH {arg}" for arg in self.extra_sbatch]

    def srun_argv(self) -> list[str]:
        request = LaunchRequest(
            script=self.script,
            script_args=self.script_args,
            torchrun_args=self.torchrun_args,
            nproc_per_node=str(self.nproc_per_node),
            launcher="slurm",
        )
        nnodes = ShellWord("$SLURM_NNODES")
        if self.dist_init_method == "slurm":
            return task_step(request, nnodes, str(self.nproc_per_node))
        endpoint = ShellWord("$MASTER_ADDR:$MASTER_PORT")
        return torchrun_step(request, nnodes, str(self.nproc_per_node), endpoint, ShellWord("$SLURM_JOB_ID"))

    def render(self) -> str:
        step = " ".join(f'"{a}"' if isinstance(a, ShellWord) else shlex.quote(a) for a in self.srun_argv())
        port = (
            str(self.master_port)
            if self.master_port is not None
            else f'$({shlex.quote(sys.executable)} -m spikingsail.launchers.slurm_port "$MASTER_ADDR")'
        )
        return "\n".join(
            [
                "#!/bin/bash",
                f"# Written by `sail submit` for {_comment(self.script)}; submit it again with: sbatch <this file>",
                *self.directives(),
                "",
                "set -euo pipefail",
                f"cd {shlex.quote(self.workdir)}",
                'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                f"MASTER_PORT={port}",
                "export MASTER_ADDR MASTER_PORT",
                *(_requeue_block(step) if self.requeue else [step]),
                "",
            ]
        )


def _requeue_block(step: str) -> list[str]:
    """Run the step in the background so this shell can catch SLURM's signals and requeue the job."""
    return [
        "# SLURM sends USR1 to this shell before the time limit (--signal) and TERM when it preempts",
        "# the job. The step gets USR1: every rank finishes its step, saves a checkpoint and exits",
        f"# with status {PREEMPTED_EXIT_CODE}. Then the job goes back into the queue, and the next run resumes.",
        "preempted=0",
        'on_signal() { preempted=1; kill -USR1 "$step" 2>/dev/null || true; }',
        "trap on_signal USR1 TERM",
        f"{step} &",
        "step=$!",
        "status=0",
        'wait "$step" || status=$?',
        'while kill -0 "$step" 2>/dev/null; do status=0; wait "$step" || status=$?; done',
        f'if [ "$preempted" = 1 ] || [ "$status" = {PREEMPTED_EXIT_CODE} ]; then',
        '    echo "sail: job $SLURM_JOB_ID stopped for preemption (status $status); requeueing it" >&2',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
    ]


def _comment(text: str) -> str:
    """``text`` on one line of a shell comment."""
    return text.replace("\r", " ").replace("\n", " ")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sail submit",
        description="Write an sbatch script that runs a training script on SLURM, and submit it.",
        allow_abbrev=False,
    )
    p.add_argument("--target", choices=["slurm"], default="slurm",
                   help="where the job runs: slurm (this page) or k8s (sail submit --target k8s --help)")  # fmt: skip
    p.add_argument("-N", "--nodes", type=int, default=1, help="nodes to allocate (#SBATCH --nodes)")
    p.add_argument(
        "--gpus-per-node",
        "--gpus-per-task",
        dest="gpus_per_node",
        type=int,
        help="GPUs per node (torchrun mode: the one task's --gpus-per-task)",
    )
    p.add_argument("--nproc-per-node", type=int, help="processes per node (default: the GPUs per node, or 1)")
    p.add_argument("-c", "--cpus-per-task", type=int, help="#SBATCH --cpus-per-task")
    p.add_argument("-p", "--partition", help="#SBATCH --partition")
    p.add_argument("-t", "--time", help="time limit, in SLURM's forms (4:00:00, 1-0); #SBATCH --time")
    p.add_argument("-A", "--account", help="#SBATCH --account")
    p.add_argument("-J", "--job-name", help="#SBATCH --job-name (default: the script's name without .py)")
    p.add_argument("-o", "--output", help="sbatch output path (default: JOB_NAME-%%j.out)")
    p.add_argument("-e", "--error", help="sbatch error path (default: with the output)")
    p.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="any other #SBATCH line, e.g. --sbatch-arg=--exclusive (repeatable)",
    )
    p.add_argument(
        "--requeue",
        action="store_true",
        help="on preemption or near the time limit, checkpoint and put the job back in the queue "
        "(the script should take --resume --checkpoints-path)",
    )
    p.add_argument(
        "--signal-before",
        type=int,
        default=120,
        metavar="SECONDS",
        help="with --requeue: how long before the time limit SLURM signals the job (1 to 65535, default 120)",
    )
    p.add_argument(
        "--dist-init-method",
        choices=DIST_INIT_METHODS,
        default="torchrun",
        help="torchrun: srun starts one torchrun agent per node; slurm: one srun task per process, "
        "ranks from SLURM_PROCID (default torchrun)",
    )
    p.add_argument("--max-restarts", type=int, help="torchrun's --max-restarts")
    p.add_argument(
        "--master-port", type=int, help="rendezvous port (default: derived from the job id, checked free)"
    )
    p.add_argument("--script-path", help="where to write the sbatch script (default: JOB_NAME.sbatch)")
    p.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    p.add_argument("--wait", action="store_true", help="wait for the job and exit with its status")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the training script's own arguments")
    return p


def parse_submit(argv: list[str]) -> tuple[SubmitRequest, argparse.Namespace]:
    ns = parser().parse_args(argv)
    if not Path(ns.script).is_file():
        raise LaunchError(f"training script {ns.script} does not exist", fix="check the path")
    _check_numbers(ns)
    _check_directives(ns)
    request = SubmitRequest(
        script=ns.script,
        script_args=list(ns.script_args),
        job_name=ns.job_name or Path(ns.script).stem,
        nodes=ns.nodes,
        gpus_per_node=ns.gpus_per_node,
        nproc_per_node=ns.nproc_per_node or ns.gpus_per_node or 1,
        dist_init_method=ns.dist_init_method,
        cpus_per_task=ns.cpus_per_task,
        partition=ns.partition,
        time=ns.time,
        account=ns.account,
        output=ns.output,
        error=ns.error,
        extra_sbatch=list(ns.sbatch_arg),
        # torchrun's agent passes SIGUSR1 (sbatch --signal) on to the workers only when told to
        torchrun_args=[
            *(["--max-restarts", str(ns.max_restarts)] if ns.max_restarts is not None else []),
            "--signals-to-handle",
            FORWARDED_SIGNALS,
        ],
        master_port=ns.master_port,
        requeue=ns.requeue,
        signal_before=ns.signal_before,
    )
    if ns.requeue and "--resume" not in ns.script_args and "--resume-from" not in ns.script_args:
        log.warning("--requeue without --resume in the script's arguments: a requeued run starts over")
    return request, ns


def _check_numbers(ns: argparse.Namespace) -> None:
    """Every number is checked here, before it is written into the script (sbatch, srun or torchrun
    would refuse it later on the nodes, or not at all: a negative process count)."""
    check_counts(
        {
            "--nodes": (ns.nodes, 1, MAX_NODES),
            "--gpus-per-node": (ns.gpus_per_node, 0, MAX_SLOTS),
            "--nproc-per-node": (ns.nproc_per_node, 1, MAX_SLOTS),
            "--cpus-per-task": (ns.cpus_per_task, 1, MAX_CPUS),
        }
    )
    if ns.max_restarts is not None and ns.max_restarts < 0:  # torchrun's own rule
        raise LaunchError(f"--max-restarts {ns.max_restarts}", "torchrun restarts the workers 0 or more times",
                          "give 0 (no restart) or more")  # fmt: skip
    if ns.master_port is not None:
        check_port(
            "--master-port", ns.master_port, "give a free port, or leave it out to derive one from the job id"
        )
    # at 0 there is no time left to save
    in_range("--signal-before", ns.signal_before, 1, MAX_SIGNAL_TIME, why="it is a time in seconds before the "
             "time limit", fix="give the seconds a checkpoint needs, e.g. 120 (the default)")  # fmt: skip


def _check_directives(ns: argparse.Namespace) -> None:
    """A line break in an #SBATCH value would end the directive and start a line of the script."""
    given = {"--job-name": [ns.job_name], "--partition": [ns.partition], "--time": [ns.time],
             "--account": [ns.account], "--output": [ns.output], "--error": [ns.error],
             "--sbatch-arg": ns.sbatch_arg}  # fmt: skip
    for flag, values in given.items():
        for value in values:
            if value is not None and ("\n" in value or "\r" in value):
                raise LaunchError(
                    f"{flag} {value!r} contains a line break",
                    "each value becomes one '#SBATCH' line; the rest would run as a command of the script",
                    f"give {flag} a value on one line",
                )


def submit(path: Path) -> str:
    result = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise LaunchError(
            f"sbatch rejected {path}",
            result.stderr.strip() or f"sbatch exited {result.returncode}",
            "fix the #SBATCH lines (partition, time, GPUs) or run with --dry-run to read the script",
        )
    return result.stdout.strip().split(";")[0]


def submitted(request: SubmitRequest, job_id: str, path: Path) -> str:
    output = (request.output or f"{request.job_name}-%j.out").replace("%j", job_id)
    return f"submitted job {job_id} ({path}); output in {output}"


def wait(job_id: str, poll_seconds: float = 1.0) -> tuple[str, int]:
    """Poll squeue until the job leaves the queue (sbatch --wait backs off to long sleeps)."""
    while subprocess.run(
        ["squeue", "-h", "-j", job_id], capture_output=True, text=True, check=False
    ).stdout.strip():
        time.sleep(poll_seconds)
    info = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=False
    ).stdout
    fields = dict(item.split("=", 1) for item in info.split() if "=" in item)
    state = fields.get("JobState", "UNKNOWN")
    code = int(fields.get("ExitCode", "1:0").split(":")[0])
    return state, code if state == "COMPLETED" else (code or 1)
