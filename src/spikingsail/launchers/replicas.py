"""``sail launch --ft-replicas R``: R replica groups, each under its own torchrun agents, and
torchft's lighthouse, which ``sail launch`` starts, watches and starts again if it dies.

On this machine (no ``-H``) every group is the job ``sail launch -n N`` would start: one torchrun
agent with its own rendezvous and its own ``--max-restarts``. With ``-H`` the hostfile's nodes are
split among the groups in order, the same number each, and every group is the multi-node job
``sail launch -H <its nodes>`` would start (agents over ssh or pdsh, the rendezvous on the group's
first node), run by a child ``sail launch`` that supervises its nodes as any multi-node job; the
lighthouse then listens on the address this machine has towards the nodes. Each group gets ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and
``TORCHFT_LIGHTHOUSE``; the engine reads them and joins torchft's quorum
(``spikingsail.engine.replicas``). A group whose workers die is restarted by its agents and heals
from a live group; a group whose agent itself ended (a node lost) is started again, up to
``--max-restarts`` times, while another group trains. The job ends when every group has ended; its
status is the first failing group's.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import importlib.util
import logging
import os
import pickle
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from spikingsail.environments.replica_groups import (
    ENV_GROUP,
    ENV_GROUPS,
    ENV_LIGHTHOUSE,
    ENV_SECRET,
    SECRET_BYTES,
    address_on_route_to,
)
from spikingsail.errors import LaunchError
from spikingsail.launchers.command import LaunchCommand, python_module
from spikingsail.launchers.failure import Failure
from spikingsail.launchers.lifeline import die_with_this_process
from spikingsail.launchers.spec import LaunchRequest
from spikingsail.launchers.supervision import TIMED_OUT, Signals, watch
from spikingsail.launchers.torchrun_args import count

log = logging.getLogger(__name__)

LIGHTHOUSE_START_SECONDS = 30.0
LIGHTHOUSE_POLL_SECONDS = 0.05
ENV_GROUP_REQUEST = "SPIKINGSAIL_GROUP_REQUEST"
"""How the child ``sail launch`` of a group receives its request: in its environment, never on a
command line (the request's ``--env`` values may be credentials); not a ``SAIL_`` name, which
would be shipped on to the nodes."""


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    groups: int
    heartbeat_timeout_ms: int
    join_timeout_ms: int
    lighthouse_port: int
    lighthouse_host: str = "127.0.0.1"
    """The address the groups reach the lighthouse at: this machine's address towards the nodes
    with ``-H``, else loopback."""
    secret: str = field(default_factory=lambda: secrets.token_hex(SECRET_BYTES), repr=False)
    """The job's own: a group loads another's state only when signed with it (in the groups'
    environment, or the nodes' 0600 environment file; never on a command line)."""


def plan_replica_groups(request: LaunchRequest, replicas: ReplicaPlan) -> list[LaunchCommand]:
    """The lighthouse first, then what runs each replica group here: its torchrun agent, or with
    ``-H`` a child ``sail launch`` of the group's nodes (``group_requests``)."""
    _check(request, replicas)
    quiet = _quiet_torchft()
    commands = [LaunchCommand(host="localhost", argv=lighthouse_argv(replicas), env=quiet)]
    if request.nodes:
        for sub in group_requests(request, replicas):
            env = {ENV_GROUP_REQUEST: encode_request(sub)}
            commands.append(
                LaunchCommand(host="localhost", argv=python_module("spikingsail.cli.replica_group"), env=env)
            )
        return commands
    gpus = gpu_slices(replicas.groups, request.nproc_per_node)  # may refuse: before the thread warning
    threads = one_thread_each()
    for group in range(replicas.groups):
        argv = python_module(
            "torch.distributed.run", *request.torchrun_args, request.script, *request.script_args
        )
        env = {**group_env(group, replicas), **quiet, **threads, **gpus[group]}
        commands.append(LaunchCommand(host="localhost", argv=argv, env=env))
    return commands


def gpu_slices(groups: int, nproc_per_node: str) -> list[dict[str, str]]:
    """Each group's own GPUs of this machine (``CUDA_VISIBLE_DEVICES``), when it has any.

    A group's torchrun agent numbers its processes from local rank 0, and a process takes the GPU of
    its local rank: without a mask every group would train on GPUs 0..n-1, the rest idle, and the
    groups' all-reduce (NCCL) would join two processes on one GPU, which NCCL refuses. Group g takes
    the g-th n of the GPUs this shell sees."""
    from spikingsail.backends.process_group import nvidia_gpus

    gpus = nvidia_gpus()
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = (
        [d.strip() for d in mask.split(",") if d.strip() and d.strip() != "-1"]
        if mask is not None
        else [str(i) for i in range(gpus)]
    )
    if not gpus or not visible:  # a CPU machine (whatever a mask names), or GPUs hidden on purpose
        return [{} for _ in range(groups)]
    per_group = count(nproc_per_node)
    if per_group is None or per_group * groups > len(visible):
        shown = f"{len(visible)} GPU(s)" + (f" (CUDA_VISIBLE_DEVICES={mask})" if mask is not None else "")
        most = len(visible) // groups
        raise LaunchError(
            f"--ft-replicas {groups} with --nproc-per-node {nproc_per_node} on this machine, which shows {shown}",
            "each replica group trains on GPUs of its own, one per process, and two processes on one GPU "
            "cannot join the groups' NCCL all-reduce",
            (f"give a process count with -n, at most {most} here, or " if most else "")
            + "spread the groups over nodes with -H (or hide the GPUs with CUDA_VISIBLE_DEVICES= to train on the CPU)",
        )
    return [
        {"CUDA_VISIBLE_DEVICES": ",".join(visible[g * per_group : (g + 1) * per_group])}
        for g in range(groups)
    ]


def one_thread_each() -> dict[str, str]:
    """torchrun's rule for more than one process on a machine, for the groups that share this one.

    torchrun sets ``OMP_NUM_THREADS=1`` when it starts more than one process per node and the shell
    has not set it; a group's agent starts only the group's own processes, so with ``-n 1`` it sets
    nothing, and R processes each running as many threads as the machine has cores fight over them
    (on 2 cores, a step of a small model took 9× as long). Each group's workers run one thread
    unless this shell says otherwise."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    log.warning("setting OMP_NUM_THREADS=1 for every process of the replica groups on this machine, as "
                "torchrun does for several processes per node; set it in the shell to choose another")  # fmt: skip
    return {"OMP_NUM_THREADS": "1"}


def _quiet_torchft() -> dict[str, str]:
    """torchft's Rust parts log every quorum and vote at INFO: warnings and errors only, unless this
    shell sets RUST_LOG."""
    return {"RUST_LOG": os.environ.get("RUST_LOG", "warn")}


def group_env(group: int, replicas: ReplicaPlan) -> dict[str, str]:
    return {
        ENV_GROUP: str(group),
        ENV_GROUPS: str(replicas.groups),
        ENV_LIGHTHOUSE: f"http://{replicas.lighthouse_host}:{replicas.lighthouse_port}",
        ENV_SECRET: replicas.secret,
    }


def group_requests(request: LaunchRequest, replicas: ReplicaPlan) -> list[LaunchRequest]:
    """With ``-H``: each group's own multi-node request, its nodes a consecutive slice of the
    hostfile's, its rendezvous on its first node, the group's variables shipped to its nodes."""
    assert request.nodes
    per_group = len(request.nodes) // replicas.groups
    quiet = _quiet_torchft()
    return [
        dataclasses.replace(
            request,
            nodes=request.nodes[group * per_group : (group + 1) * per_group],
            env={**quiet, **request.env, **group_env(group, replicas)},
            rdzv_id=f"{request.rdzv_id}-group{group}" if request.rdzv_id else None,
            ft_replicas=0,
        )
        for group in range(replicas.groups)
    ]


def encode_request(request: LaunchRequest) -> str:
    return base64.b64encode(pickle.dumps(request)).decode()


def decode_request(text: str) -> LaunchRequest:
    request = pickle.loads(base64.b64decode(text))  # noqa: S301 - written by this user's sail launch
    assert isinstance(request, LaunchRequest)
    return request


def _check(request: LaunchRequest, replicas: ReplicaPlan) -> None:
    from spikingsail.launchers import LAUNCHERS  # the registry imports the launchers, which import this

    hosting = [name for name, launcher in LAUNCHERS.items() if launcher.hosts_replica_groups]
    if request.nodes and not LAUNCHERS[request.launcher].hosts_replica_groups:
        raise LaunchError(
            f"--ft-replicas with --launcher {request.launcher}",
            "each replica group runs under torchrun agents of its own, which sail launch starts on "
            f"the group's nodes over {' or '.join(hosting)}",
            f"use --launcher {' or --launcher '.join(hosting)} (ssh is the default with -H)",
        )
    if not request.nodes and not LAUNCHERS[request.launcher].agents_here:
        raise LaunchError(
            f"--ft-replicas with --launcher {request.launcher} and no -H",
            "replica groups run under torchrun agents that sail launch starts itself: on this "
            "machine, or on a hostfile's nodes over ssh or pdsh",
            "pass -H hostfile (the groups are spread over its nodes), or run on one machine with -n",
        )
    if not request.nodes:
        return
    nodes = len(request.nodes)
    if nodes < replicas.groups or nodes % replicas.groups:
        raise LaunchError(
            f"--ft-replicas {replicas.groups} over {nodes} node(s)",
            "every replica group runs on nodes of its own, the same number of nodes each",
            f"give a multiple of {replicas.groups} nodes (one group per node: --ft-replicas {nodes}), "
            "or run the groups on one machine without -H",
        )
    if request.rdzv_endpoint:
        raise LaunchError(
            f"--rdzv-endpoint {request.rdzv_endpoint} with --ft-replicas and -H",
            "every replica group has a rendezvous of its own, on its first node",
            "leave --rdzv-endpoint out (--master-port chooses the port)",
        )


def lighthouse_argv(replicas: ReplicaPlan) -> list[str]:
    """torchft's lighthouse (``torchft_lighthouse.py``), listening only on the address the groups
    reach it at."""
    program = Path(__file__).with_name("torchft_lighthouse.py")
    return [
        sys.executable, str(program), "--min_replicas", "1", "--quorum_tick_ms", "100",
        "--join_timeout_ms", str(replicas.join_timeout_ms),
        "--heartbeat_timeout_ms", str(replicas.heartbeat_timeout_ms),
        "--bind", f"{replicas.lighthouse_host}:{replicas.lighthouse_port}",
    ]  # fmt: skip


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Straight to the lighthouse, never through the shell's http_proxy (a cluster's often is set)."""


def start_lighthouse(
    command: LaunchCommand, replicas: ReplicaPlan, within: float = LIGHTHOUSE_START_SECONDS
) -> subprocess.Popen[bytes] | None:
    """Start the lighthouse and return it once it answers on its address; None when it ended first
    (its port was taken after ``free_port`` chose it: the caller chooses another). A lighthouse that
    cannot listen would otherwise leave the groups waiting for it until torchft's connect timeout."""
    if importlib.util.find_spec("torchft") is None:
        raise LaunchError(
            f"torchft is not installed in {sys.prefix}",
            "--ft-replicas runs torchft: its lighthouse forms each step's quorum",
            "install the pinned torchft (scripts/setup.sh does), or launch without --ft-replicas",
        )
    address = f"{replicas.lighthouse_host}:{replicas.lighthouse_port}"
    lighthouse = _start(command)
    deadline = time.monotonic() + within
    while lighthouse.poll() is None:
        try:
            with _DIRECT.open(f"http://{address}/status", timeout=1) as answer:
                if b"quorum" in answer.read():  # its status page, not another program on the port
                    return lighthouse
        except OSError:
            pass
        if time.monotonic() > deadline:
            lighthouse.kill()
            lighthouse.wait()
            raise LaunchError(
                f"torchft's lighthouse did not answer at {address} within {within:.0f} s",
                "the replica groups form each step's quorum through it",
                "check that nothing on this machine blocks that address (a firewall), then launch again",
            )
        time.sleep(LIGHTHOUSE_POLL_SECONDS)
    return None


def address_towards(hosts: list[str]) -> str:
    """This machine's address on the route to the first of ``hosts`` reached through a
    non-loopback address: where processes on those hosts reach a server of this machine
    (loopback when every host is this machine's loopback)."""
    loopback = True
    for host in hosts:
        try:
            infos = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)
        except OSError:
            loopback = False
            continue
        for *_, target in infos:
            ip = str(target[0])
            if ip.startswith("127."):
                continue
            loopback = False
            try:
                address = address_on_route_to(ip, int(target[1]))
            except OSError:
                continue
            if not address.startswith("127."):
                return address
    if loopback:
        return "127.0.0.1"
    raise LaunchError(
        f"no address of this machine towards the nodes ({', '.join(hosts)}): they do not resolve here, "
        "or have no route but loopback",
        "with --ft-replicas -H, torchft's lighthouse runs here and the groups on the nodes must reach it",
        "run sail launch on a machine of the cluster's network (e.g. the first node), with hostnames "
        "that resolve there to the nodes' addresses",
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_replica_groups(
    commands: list[LaunchCommand],
    lighthouse: subprocess.Popen[bytes],
    restarts: int = 0,
    timeout: float | None = None,
) -> int:
    """Start the groups (``lighthouse``, already serving, is ``start_lighthouse``'s); start the
    lighthouse again whenever it dies while a group runs, and a group that failed (its agent or a
    node of it lost) up to ``restarts`` times while another group runs (it heals from that group);
    pass signals on to the groups. Returns the first failing group's status (0: all ended well)."""
    with Signals() as signals:
        return watch(_Groups(commands, lighthouse, restarts), signals, timeout)[0]


class _Groups:
    """The replica groups and their lighthouse (``supervision.Job``): every signal is passed on to
    the groups, whose agents pass it to their workers; nothing is restarted after one."""

    drain_seconds: float | None = None

    def __init__(
        self, commands: list[LaunchCommand], lighthouse: subprocess.Popen[bytes], restarts: int
    ) -> None:
        self._lighthouse_command, *self._groups = commands
        self._lighthouse = lighthouse
        self._restarts = restarts
        self._agents = [_start(command) for command in self._groups]
        self._started = [1] * len(self._agents)
        self._timed_out = False

    def forward(self, signum: int) -> None:
        for agent in self._agents:
            with contextlib.suppress(ProcessLookupError):
                agent.send_signal(signum)

    def ended(self, draining: bool) -> bool:
        if draining:
            return all(agent.poll() is not None for agent in self._agents)
        if self._lighthouse.poll() is not None:
            log.warning(
                "torchft's lighthouse ended (status %s): starting it again", self._lighthouse.returncode
            )
            self._lighthouse = _start(self._lighthouse_command)
        agents = self._agents
        for group, agent in enumerate(agents):
            others = any(a.poll() is None for g, a in enumerate(agents) if g != group)
            if agent.poll() and others and self._started[group] <= self._restarts:
                log.warning(
                    "replica group %d ended with status %s while the others train: starting it "
                    "again (%d of --max-restarts %d); it heals from a live group",
                    group, agent.returncode, self._started[group], self._restarts,
                )  # fmt: skip
                agents[group] = _start(self._groups[group])
                self._started[group] += 1
        return all(agent.poll() is not None for agent in agents)

    def time_out(self) -> None:
        self._timed_out = True

    def stop(self) -> None:
        for agent in self._agents:  # only on an error: the loop waits for every group
            if agent.poll() is None:
                agent.terminate()  # a group's own sail launch stops its nodes' processes
                try:
                    agent.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    agent.kill()
                    agent.wait()
        self._lighthouse.terminate()
        try:
            self._lighthouse.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._lighthouse.kill()
            self._lighthouse.wait()

    def status(self) -> tuple[int, Failure | None]:
        if self._timed_out:
            return TIMED_OUT, None
        return next((code for code in (agent.returncode for agent in self._agents) if code), 0), None


def _start(command: LaunchCommand) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        command.argv,
        env={**os.environ, **command.env},
        preexec_fn=die_with_this_process(),  # noqa: PLW1509 - started from the main thread
    )
