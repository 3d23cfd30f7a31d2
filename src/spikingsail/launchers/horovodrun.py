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
SpikingSail ships an explicit environment instead (``remote_env``: the allow-list, ``.sail_env``,
``--env``), so horovodrun starts with an empty environment plus those variables, the HOROVOD_*
tuning variables of the shell, and what horovodrun and ssh need on this machine (PATH, HOME, USER,
SSH_AUTH_SOCK: the path of this machine's agent socket, which horovodrun's ssh needs). The values
are in horovodrun's environment, not on its command line; but horovodrun itself writes what it
forwards on the ssh command line of every remote host, where ``ps`` shows it for the whole job, so a
credential (``looks_secret``) for remote hosts is refused rather than shipped that way. horovodrun
stops every rank when one fails.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
import uuid

from spikingsail.errors import LaunchError
from spikingsail.launchers.agents import rank_mark, rank_regex, tether, top_processes_signal
from spikingsail.launchers.base import Launcher
from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.hostfile import is_this_machine
from spikingsail.launchers.lifeline import AGENT_GRACE_SECONDS
from spikingsail.launchers.remote_env import launcher_env, looks_secret, remote_env
from spikingsail.launchers.spec import LaunchRequest, SSHOptions, require_first_slots

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
# horovodrun's (Gloo mode) report of the first failed rank; ranks' lines come as "[R]<stderr>:...".
_FIRST_EXIT = re.compile(
    r"The first process to do so was:\s*\nProcess name: (?P<rank>\d+)\s*\nExit code: (?P<code>-?\d+)"
)


class HorovodrunLauncher(Launcher):
    name = "horovodrun"
    agent_signals = False  # horovodrun's ranks are told over ssh (relay), or by horovodrun itself
    install_hint = INSTALL_HINT
    here_without_hosts = True  # as horovodrun without -H

    @staticmethod
    def exists() -> bool:
        return importlib.util.find_spec("horovod") is not None

    def probe_hosts(self, request: LaunchRequest) -> list[str]:
        # horovodrun starts this machine's ranks without ssh
        return remote_hosts(super().probe_hosts(request))

    @staticmethod
    def read_failure(text: str, tail: list[str], exit_code: int) -> tuple[str, list[str]] | None:
        found = _FIRST_EXIT.search(text)
        if found is None:
            return None
        rank = found["rank"]
        own = [line.split(":", 1)[1] for line in tail if line.startswith(f"[{rank}]<std")]
        return (f"horovodrun failed (exit status {exit_code}): rank {rank} exited with {found['code']} "
                "first", own or tail)  # fmt: skip

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
        env = {k: v for k, v in launcher_env(_LAUNCHER_VARS, ("HOROVOD_",)).items() if k not in _PER_PROCESS}
        env |= remote_env(request.env)
        env |= {"MASTER_ADDR": request.nodes[0].host, "MASTER_PORT": str(request.master_port)}
        _refuse_credentials(env, request)
        argv = [
            sys.executable, "-m", "horovod.runner.launch", "--gloo",
            "-np", str(sum(n.nproc for n in request.nodes)),
            "-H", ",".join(f"{n.host}:{n.nproc}" for n in request.nodes),
        ]  # fmt: skip
        if request.ssh.port:
            argv += ["-p", str(request.ssh.port)]
        run_id = request.rdzv_id or f"sail-{uuid.uuid4().hex[:12]}"
        program = _program(request, run_id)
        argv += [*request.launcher_args, *program]
        hosts = list(dict.fromkeys(n.host for n in request.nodes))
        if program[0] != sys.executable:  # --no-python: the ranks carry no mark to be found by
            relay, cleanup = None, None
        else:
            pattern = shlex.quote(rank_regex(run_id))
            relay = ["sh", "-c", _on_every_host(hosts, top_processes_signal(pattern), request.ssh, '"$0"')]
            cleanup = ["sh", "-c", _on_every_host(hosts, _leftover_ranks(pattern), request.ssh, "TERM")]
        command = LaunchCommand(host=",".join(hosts), argv=argv, env=env, clean_env=True, relay=relay,
                                cleanup=cleanup, stand_ins=_STAND_INS if relay is None else {})  # fmt: skip
        if relay is None:
            return [command]
        # horovodrun's ssh clients have no terminal: a lost launching host would leave the ranks running
        return [
            command,
            *(tether(request, host, rank_regex(run_id), ranks=True) for host in remote_hosts(hosts)),
        ]


# Every rank's Python runs with ``-X sail-run=RUN_ID`` (``agents.rank_mark``): the job's ranks are
# found by it on every host, to pass a signal on to them (horovodrun handles only SIGINT and SIGTERM,
# and only by stopping every rank with SIGTERM), to end what is left on a remote host after
# horovodrun was stopped (its ssh clients have no terminal, so a remote rank gets no hang-up), and by
# each host's tether.
# With --no-python there is no mark: signals go to horovodrun, which stops every rank with SIGTERM.
_STAND_INS = {"SIGHUP": "SIGTERM", "SIGQUIT": "SIGTERM", "SIGUSR1": "SIGTERM"}


def _program(request: LaunchRequest, run_id: str) -> list[str]:
    """What every rank runs: the script with this Python (or -m module, or --no-python as is)."""
    if request.no_python:
        return [request.script, *request.script_args]
    python = [sys.executable, *rank_mark(run_id)]
    if request.runs_module:
        return [*python, "-m", request.script, *request.script_args]
    return [*python, request.script, *request.script_args]


def _leftover_ranks(pattern: str) -> str:
    """A shell line (``$0``: TERM) for a host after horovodrun was stopped: the job's ranks there
    get SIGTERM and ``AGENT_GRACE_SECONDS`` to end, then what is left of them is killed and named."""
    ticks = AGENT_GRACE_SECONDS * 2
    return (
        f"{top_processes_signal(pattern)}; "
        f"i=0; while pgrep --ns $$ --nslist net -f -- {pattern} >/dev/null && [ $i -lt {ticks} ]; "
        "do sleep 0.5; i=$((i+1)); done; "
        f"for p in $(pgrep --ns $$ --nslist net -f -- {pattern}); do kill -KILL $p && "
        'echo "killed rank process $p on $(hostname): it did not stop on SIGTERM"; done; true'
    )


def _on_every_host(hosts: list[str], line: str, ssh: SSHOptions, arg: str) -> str:
    """A shell script that runs ``sh -c LINE ARG`` on every host at once (here, or over ssh) and
    waits; ``ARG`` is the line's ``$0``, the name of the signal to send."""
    runs = []
    for host in hosts:
        local = ["sh", "-c", line]
        argv = local if is_this_machine(host) else ssh.command(host, shlex.join(local))
        runs.append(f"{shlex.join(argv)} {arg} &")
    return " ".join([*runs, "wait"])


def _refuse_credentials(env: dict[str, str], request: LaunchRequest) -> None:
    assert request.nodes
    secrets = sorted(k for k in env if looks_secret(k) and k != "SSH_AUTH_SOCK")
    remote = remote_hosts([n.host for n in request.nodes]) if secrets else []
    if remote:
        raise LaunchError(
            f"--launcher horovodrun would show {', '.join(secrets)} on the ssh command line of {remote[0]}",
            "horovodrun forwards its environment to remote hosts as 'export NAME=VALUE' on ssh's command "
            "line, which every user of both machines can read with ps for the whole job",
            "use --launcher ssh, pdsh or mpirun (they send values over ssh's standard input or in "
            "mpirun's environment), or set the variable on the nodes themselves",
        )


def remote_hosts(hosts: list[str]) -> list[str]:
    """The hosts horovodrun reaches over ssh: those whose address is not one of this machine's."""
    return [host for host in hosts if not is_this_machine(host)]
