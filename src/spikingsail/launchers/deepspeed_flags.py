"""DeepSpeed's launcher flags that neither torchrun's parser nor SpikingSail's own flags have.

Each either asks for what ``sail launch`` does anyway (accepted, with no effect) or for something
it has no counterpart of (refused before anything starts, saying what to use instead). The rest of
DeepSpeed's flags are torchrun's (``--master_port``, ``--node_rank``, ``--module``, ``--no_python``)
or SpikingSail's (``-H``, ``-i``, ``-e``, ``--num_nodes``, ``--num_gpus``, ``--launcher``,
``--launcher_args``, ``--ssh_port``). ``tests/launchers/test_peer_flags.py`` takes every flag of the
installed DeepSpeed's own parser and checks that ``sail launch`` knows it, taking a value where
DeepSpeed does. The from-DeepSpeed page shows this table.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from spikingsail.errors import LaunchError


@dataclass(frozen=True, slots=True)
class DeepSpeedFlag:
    spellings: tuple[str, ...]
    metavar: str | None
    """What the flag takes (None: nothing)."""
    deepspeed_does: str
    accepted: bool
    """True: ``sail launch`` does this anyway; False: it is refused."""
    here: str
    """What ``sail launch`` does (accepted), or what to use instead (refused)."""

    @property
    def dest(self) -> str:
        return "deepspeed_" + self.spellings[-1].lstrip("-").replace("-", "_")


FLAGS = (
    DeepSpeedFlag(
        ("--no_local_rank",), None,
        "does not pass `--local_rank=N` to the script (it does by default)",
        True,
        "the same, always: as torchrun, it sets `LOCAL_RANK` in each process's environment and passes "
        "no `--local_rank` (a script that takes one reads `os.environ[\"LOCAL_RANK\"]` instead)",
    ),
    DeepSpeedFlag(
        ("--force_multi",), None,
        "starts a hostfile of one host through ssh or pdsh (without it, it runs that host's part here)",
        True,
        "the same, always: the hostfile's hosts are started through the launcher, one host as many",
    ),
    DeepSpeedFlag(
        ("--no_ssh_check",), None,
        "skips its check that every host answers ssh before the launch",
        True,
        "the same, always: nothing is checked before the launch; a host that does not answer within "
        "`--connect-timeout` ends the launch, named (`sail doctor -H hostfile` checks them all first)",
    ),
    DeepSpeedFlag(
        ("--no_ssh",), None,
        "starts only this node's part, with `--node_rank` and `--master_addr`",
        False,
        "on each node, run `sail launch` without `-H`, with torchrun's `--nnodes N --node-rank R "
        "--master-addr HOST --master-port PORT`",
    ),
    DeepSpeedFlag(
        ("--save_pid",), None,
        "writes its process id to `/tmp/<pid>.ds`",
        False,
        "signal `sail launch` itself (`$!` of the shell that started it): SIGTERM or SIGINT ends the job "
        "on every node (a file of a known name in the shared `/tmp` could be another user's)",
    ),
    DeepSpeedFlag(
        ("--enable_each_rank_log",), "DIR",
        "writes each rank's output to a file of its own under DIR",
        False,
        "use torchrun's `--log-dir DIR --redirects 3` (each rank's stdout and stderr in files of their "
        "own under DIR)",
    ),
    DeepSpeedFlag(
        ("--autotuning",), "{tune,run}",
        "runs DeepSpeed's autotuner to choose the config",
        False,
        "tune with DeepSpeed's own launcher (`deepspeed --autotuning tune ...`), then launch the config "
        "it writes with `sail launch`",
    ),
    DeepSpeedFlag(
        ("--bind_cores_to_rank",), None,
        "binds each rank to cores of its own (numactl)",
        False,
        "use torchrun's `--numa-binding` on GPU nodes, or bind in the script "
        "(`os.sched_setaffinity`, from `LOCAL_RANK`)",
    ),
    DeepSpeedFlag(
        ("--bind_core_list",), "CORES",
        "binds the ranks to the listed cores (numactl)",
        False,
        "bind in the script (`os.sched_setaffinity`, from `LOCAL_RANK`)",
    ),
    DeepSpeedFlag(
        ("--venv_script",), "SCRIPT",
        "sources SCRIPT on each node before starting it",
        False,
        "each node runs this same Python (`sys.executable`, which must exist there too: a shared file "
        "system or the same image); give variables with `--env KEY=VALUE`",
    ),
    DeepSpeedFlag(
        ("--log_level",), "LEVEL",
        "sets its launcher's own log level",
        False,
        "set `SAIL_LOG_LEVEL=LEVEL` in the environment (SpikingSail's log level, in the launcher and "
        "the ranks)",
    ),
    DeepSpeedFlag(
        ("-q", "--quiet"), None,
        "sets its launcher's own log level to error",
        False,
        "set `SAIL_LOG_LEVEL=ERROR` in the environment (SpikingSail's log level, in the launcher and the "
        "ranks)",
    ),
)  # fmt: skip


LAUNCHER_NAMES = {"openmpi": "mpirun"}
"""DeepSpeed's ``--launcher`` names for SpikingSail's launchers."""
OTHER_MPIS = ("mvapich", "impi", "mpich")
"""DeepSpeed's ``--launcher`` names for MPIs SpikingSail does not start."""


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("DeepSpeed's launcher (accepted where sail launch does the same)")
    for flag in FLAGS:
        kind = "same as in DeepSpeed" if flag.accepted else "refused"
        if flag.metavar is None:
            group.add_argument(
                *flag.spellings, dest=flag.dest, action="store_true", help=f"DeepSpeed's; {kind}"
            )
        else:
            group.add_argument(
                *flag.spellings, dest=flag.dest, metavar=flag.metavar, help=f"DeepSpeed's; {kind}"
            )


def read_flags(ns: argparse.Namespace) -> None:
    """Refuse the DeepSpeed flags given that ``sail launch`` has no counterpart of; a DeepSpeed
    ``--launcher`` name becomes SpikingSail's."""
    if ns.launcher in OTHER_MPIS:
        raise LaunchError(
            f"--launcher {ns.launcher}: SpikingSail does not start jobs with this MPI",
            "it starts MPI jobs with Open MPI's mpirun, as DeepSpeed's --launcher openmpi does",
            "use --launcher mpirun (or openmpi), or ssh, pdsh, slurm",
        )
    ns.launcher = LAUNCHER_NAMES.get(ns.launcher, ns.launcher)
    for flag in FLAGS:
        if not flag.accepted and getattr(ns, flag.dest) not in (None, False):
            raise LaunchError(
                f"{flag.spellings[-1]}: sail launch has no such option",
                f"DeepSpeed's launcher {flag.deepspeed_does}",
                flag.here,
            )


def table() -> str:
    """The flags as a Markdown table, for the from-DeepSpeed page."""
    lines = ["| you write | DeepSpeed | SpikingSail |", "|---|---|---|"]
    for flag in FLAGS:
        given = " ".join(f"`{s}{'' if flag.metavar is None else ' ' + flag.metavar}`" for s in flag.spellings)
        here = flag.here if flag.accepted else f"refuses it: {flag.here}"
        lines.append(f"| {given} | {flag.deepspeed_does} | {here} |")
    return "\n".join(lines)
