"""horovodrun (Gloo mode): one process per slot, started by horovodrun itself over ssh.

    sail launch --launcher horovodrun -H node1:2,node2:2 [-np 3] train.py ARGS
    sail launch --launcher horovodrun -np 2 train.py ARGS          (without -H: localhost:2)

becomes ``python -m horovod.runner.launch --gloo -np N -H node1:2,node2:2 python train.py ARGS``
(``horovod.runner.launch`` is horovodrun, run by the Python that runs sail, so that horovodrun and
the ranks use that Python's Horovod). Ranks come from horovodrun's HOROVOD_* variables
(``HorovodEnvironment``); MASTER_ADDR (the first host) and MASTER_PORT are exported too, so that the
ddp and fsdp backends also run under horovodrun, and the horovod backend meets there for its
torch.distributed group.

horovodrun forwards its whole environment to every rank, on the ssh command line of remote hosts.
SpikingSail ships an explicit environment instead (``remote_env``: allowed prefixes, ``.sail_env``,
``--env``), so horovodrun starts under ``env -i`` with those variables, the HOROVOD_* tuning variables
of the shell, and what horovodrun and ssh need on this machine (PATH, HOME, USER, SSH_AUTH_SOCK).
horovodrun stops every rank when one fails.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import sys

from spikingsail.errors import LaunchError
from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.remote_env import remote_env
from spikingsail.launchers.request import LaunchRequest, require_first_slots

INSTALL_HINT = (
    'pip install "$(bash scripts/build-horovod.sh PYTHON)" (builds Horovod 0.28.1 with PyTorch and Gloo '
    "for this torch; the script is in the SpikingSail source tree)"
)
# What horovodrun itself needs here: ssh to the hosts, ssh keys, its check cache in ~/.horovod.
_LAUNCHER_VARS = ("PATH", "HOME", "USER", "SSH_AUTH_SOCK")
# Set by horovodrun for every process; from the shell they would override horovodrun's values.
_PER_PROCESS = frozenset(
    {
        "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
        "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
        "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS", "HOROVOD_GLOO_IFACE",
    }
)  # fmt: skip
_NO_PYTHON_FLAGS = ("--no-python", "--no_python")


class HorovodrunLauncher:
    name = "horovodrun"

    @staticmethod
    def exists() -> bool:
        return importlib.util.find_spec("horovod") is not None

    def commands(self, request: LaunchRequest) -> list[LaunchCommand]:
        require_first_slots(request, "horovodrun")
        assert request.nodes  # checked there
        for given, flag in ((request.ssh.user, "--ssh-user"), (request.ssh.config, "--ssh-config")):
            if given:
                raise LaunchError(
                    f"--launcher horovodrun cannot pass {flag} to ssh",
                    "horovodrun runs plain ssh with only a port (-p) and an identity file (-i)",
                    "set User (and other options) for the hosts in ~/.ssh/config instead",
                )
        shell = os.environ
        env = {k: shell[k] for k in _LAUNCHER_VARS if k in shell}
        env |= {k: v for k, v in shell.items() if k.startswith("HOROVOD_") and k not in _PER_PROCESS}
        env |= remote_env(request.env)
        env |= {"MASTER_ADDR": request.nodes[0].host, "MASTER_PORT": str(request.master_port)}
        argv = ["env", "-i", *(f"{k}={v}" for k, v in sorted(env.items()))]
        argv += [
            sys.executable, "-m", "horovod.runner.launch", "--gloo",
            "-np", str(sum(n.nproc for n in request.nodes)),
            "-H", ",".join(f"{n.host}:{n.nproc}" for n in request.nodes),
        ]  # fmt: skip
        if request.ssh.port:
            argv += ["-p", str(request.ssh.port)]
        argv += [*request.launcher_args, *_program(request)]
        return [LaunchCommand(host=",".join(n.host for n in request.nodes), argv=argv)]


def _program(request: LaunchRequest) -> list[str]:
    """What every rank runs: the script with this Python (or -m module, or --no-python as is)."""
    flags = {arg.split("=", 1)[0] for arg in request.torchrun_args}
    if flags & set(_NO_PYTHON_FLAGS):
        return [request.script, *request.script_args]
    if request.runs_module:
        return [sys.executable, "-m", request.script, *request.script_args]
    return [sys.executable, request.script, *request.script_args]


def remote_hosts(hosts: list[str]) -> list[str]:
    """The hosts horovodrun reaches over ssh: those whose address is not one of this machine's."""
    return [host for host in hosts if not _is_local(host)]


def _is_local(host: str) -> bool:
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe, contextlib.suppress(OSError):
        probe.bind((address, 0))  # only this machine's own addresses can be bound
        return True
    return False
