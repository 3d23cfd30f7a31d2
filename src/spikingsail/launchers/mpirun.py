"""Open MPI's mpirun: one process per slot, started by mpirun's own daemons over ssh.

There is no torchrun agent here: ranks come from OMPI_COMM_WORLD_* and the engine's process group
meets at MASTER_ADDR (the first host) and MASTER_PORT, exported to every rank with ``-x``; a plain
torchrun script gets torchrun's variables too (``as_torchrun``). mpirun stops every rank when one
fails, and passes SIGUSR1 on to the ranks. It ignores SIGQUIT (and cannot be told to pass it on),
so the job gets SIGTERM in its place.

``-x NAME`` without a value exports mpirun's own value of NAME: the values are in mpirun's
environment, not on its command line, where ``ps`` would show them for the whole job. mpirun starts
with only what it needs of this shell besides them (``launcher_env``): the ranks on this node
inherit its environment, and must get what the other nodes' ranks get, not this shell's secrets or
GPU mask.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import uuid

from spikingsail.launchers.agents import rank_mark, rank_regex, tether
from spikingsail.launchers.as_torchrun import shimmed
from spikingsail.launchers.base import Launcher
from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.hostfile import is_this_machine
from spikingsail.launchers.remote_env import launcher_env, remote_env
from spikingsail.launchers.spec import LaunchRequest, require_first_slots

# What mpirun itself needs here: its programs and libraries, ssh to the hosts and ssh's keys.
_LAUNCHER_VARS = ("PATH", "LD_LIBRARY_PATH", "HOME", "USER", "LOGNAME", "TMPDIR", "SSH_AUTH_SOCK")
_TUNING = ("OMPI_", "OPAL_", "PMIX_")  # Open MPI's settings (OMPI_MCA_*), its install prefix
# mpirun's reports of the first failed rank.
_SIGNALLED = re.compile(
    r"process rank (?P<rank>\d+) with PID \d+ on node (?P<host>\S+) exited on (?P<what>signal \d+[^\n]*)"
)
_EXITED = re.compile(r"Process name:\s*\[\[\d+,\d+\],(?P<rank>\d+)\]\s*\n\s*Exit code:\s*(?P<what>-?\d+)")


class MpirunLauncher(Launcher):
    name = "mpirun"
    agent_signals = False  # mpirun passes signals on to the ranks itself
    install_hint = "apt-get install openmpi-bin"

    @staticmethod
    def exists() -> bool:
        return shutil.which("mpirun") is not None

    @staticmethod
    def read_failure(text: str, tail: list[str], exit_code: int) -> tuple[str, list[str]] | None:
        found = _SIGNALLED.search(text) or _EXITED.search(text)
        if found is None:
            return None
        where = f"node {found['host']}, " if "host" in found.groupdict() else ""
        detail = f"{where}rank {found['rank']} exited with {found['what']}"
        return f"mpirun failed (exit status {exit_code}): {detail}", tail

    def commands(self, request: LaunchRequest) -> list[LaunchCommand]:
        require_first_slots(request, "mpirun")
        assert request.nodes  # checked there
        shipped = {
            **remote_env(request.env),
            "MASTER_ADDR": request.nodes[0].host,
            "MASTER_PORT": str(request.master_port),
        }
        argv = ["mpirun"]
        if os.geteuid() == 0:
            argv.append("--allow-run-as-root")  # Open MPI refuses root unless told; containers run as root
        argv += [
            "-np", str(sum(n.nproc for n in request.nodes)),
            "--host", ",".join(f"{n.host}:{n.nproc}" for n in request.nodes),
            "--mca", "plm_rsh_args", shlex.join(request.ssh.args()),
            "--wdir", os.getcwd(),
        ]  # fmt: skip
        for key in sorted(shipped):
            argv += ["-x", key]
        run_id = request.rdzv_id or f"sail-{uuid.uuid4().hex[:12]}"
        argv += [*request.launcher_args, *shimmed(request, rank_mark(run_id))]
        env = launcher_env(_LAUNCHER_VARS, _TUNING) | shipped
        hosts = list(dict.fromkeys(n.host for n in request.nodes))
        return [
            LaunchCommand(host=",".join(hosts), argv=argv, env=env, clean_env=True,
                          stand_ins={"SIGQUIT": "SIGTERM"}),
            # mpirun's daemons do not notice a lost launching host (measured: ranks ran on for minutes)
            *(tether(request, host, rank_regex(run_id), ranks=True) for host in hosts if not is_this_machine(host)),
        ]  # fmt: skip
