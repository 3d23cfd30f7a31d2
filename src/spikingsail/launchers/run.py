"""Run a launch request: the entry point behind ``sail launch``.

A request runs in one of three shapes, each a ``supervision.Job`` under the one supervision loop:
torchrun's agent on this machine (``local``), the commands of a multi-node job after its hosts were
reached (``supervisor``), or replica groups and their lighthouse (``replicas``). The job's failure
is reported last, after everything it printed.
"""

from __future__ import annotations

import logging
import sys

from spikingsail.errors import LaunchError
from spikingsail.launchers import launcher_for, plan
from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.failure import Failure, known_cause
from spikingsail.launchers.local import run_local
from spikingsail.launchers.preflight import check_config, check_hosts, config_paths
from spikingsail.launchers.replicas import (
    ReplicaPlan,
    address_towards,
    free_port,
    group_requests,
    plan_replica_groups,
    run_replica_groups,
    start_lighthouse,
)
from spikingsail.launchers.spec import LaunchRequest
from spikingsail.launchers.supervisor import supervise

log = logging.getLogger(__name__)

LIGHTHOUSE_PORT_TRIES = 5


def launch(request: LaunchRequest) -> int:
    """Check the job's config once here (not from every rank once started), then print the plan
    (``--dry-run``) or run the job; returns its exit status."""
    for path in config_paths(request.script_args, request.script):
        check_config(path, request.world_size, request.ft_replicas)
    if request.ft_replicas:
        return _run_replica_groups(request)
    if request.dry_run:
        for command in plan(request):
            print(command.render())
        return 0
    return run_request(request)


def run_request(request: LaunchRequest) -> int:
    """Plan and run one job (here, or on its nodes), and report its failure last."""
    commands = plan(request)
    launcher = launcher_for(request)
    if not launcher.supervised:
        (command,) = commands
        log.info("launching %s process(es): %s", request.nproc_per_node, command.render())
        status, failure = run_local(command)
    else:
        if request.nodes:
            reached = launcher.probe_hosts(request)
            if reached:
                check_hosts(reached, request.ssh, _rendezvous(request, reached))
            hosts = ", ".join(f"{n.host}×{n.nproc}" for n in request.nodes)
            log.info("launching on %d node(s) with %s: %s", len(request.nodes), request.launcher, hosts)
        else:
            log.info("launching with %s: %s", request.launcher, commands[0].render())
        status, failure = supervise(commands)
    if failure is not None:
        _report(failure)
    return status


def _run_replica_groups(request: LaunchRequest) -> int:
    replicas, commands = _plan_replica_groups(request)
    if request.dry_run:
        print(commands[0].render())
        if request.nodes:
            for group, sub in enumerate(group_requests(request, replicas)):
                print(f"# replica group {group}")
                for command in plan(sub):
                    print(command.render())
        else:
            for command in commands[1:]:
                print(command.render())
        return 0
    for _ in range(LIGHTHOUSE_PORT_TRIES):
        lighthouse = start_lighthouse(commands[0], replicas)
        if lighthouse is not None:
            break
        log.warning("torchft's lighthouse could not listen on port %d (taken since it was chosen, see "
                    "above): choosing another", replicas.lighthouse_port)  # fmt: skip
        replicas, commands = _plan_replica_groups(request)
    else:
        raise LaunchError(
            f"torchft's lighthouse ended at its start {LIGHTHOUSE_PORT_TRIES} times, on as many free ports",
            "the replica groups form each step's quorum through it",
            "see its error above",
        )
    where = (
        f"over {len(request.nodes)} nodes ({len(request.nodes) // replicas.groups} per group)"
        if request.nodes
        else "on this machine"
    )
    restarts = (
        f"a group that fails is started again up to {request.max_restarts} time(s) (--max-restarts)"
        if request.max_restarts
        else "a group that fails stays down (--max-restarts 0); the others finish and the job fails"
    )
    log.info("launching %d replica groups of %s process(es) per node %s with torchft's lighthouse at %s:%d; %s",
             replicas.groups, request.nproc_per_node, where, replicas.lighthouse_host,
             replicas.lighthouse_port, restarts)  # fmt: skip
    return run_replica_groups(commands, lighthouse, request.max_restarts)


def _plan_replica_groups(request: LaunchRequest) -> tuple[ReplicaPlan, list[LaunchCommand]]:
    """The lighthouse on a port free now, and the groups that reach it there."""
    heartbeat_ms = max(1, round(request.ft_heartbeat_timeout * 1000))
    replicas = ReplicaPlan(
        groups=request.ft_replicas,
        heartbeat_timeout_ms=heartbeat_ms,
        join_timeout_ms=max(10 * heartbeat_ms, 10_000),
        lighthouse_port=free_port(),
        lighthouse_host=address_towards([n.host for n in request.nodes]) if request.nodes else "127.0.0.1",
    )
    return replicas, plan_replica_groups(request, replicas)


def _rendezvous(request: LaunchRequest, reached: list[str]) -> tuple[str, int] | None:
    """The (host, port) the job's store will listen on, when it is one of the hosts reached over
    ssh: the torchrun agents' c10d store (ssh, pdsh) or rank 0's (mpirun, horovodrun)."""
    assert request.nodes
    host, port = request.nodes[0].host, request.master_port
    if request.rdzv_endpoint:
        host, _, given = request.rdzv_endpoint.rpartition(":")
        if not given.isdigit():
            return None  # torchrun's own default port: it reports a taken one itself
        port = int(given)
    return (host, port) if host in reached else None


def _report(failure: Failure) -> None:
    """The job's failure reason, last: the rank's own SpikingSail error when it stopped on one."""
    text = failure.describe()
    if failure.reported is None:
        why, fix = known_cause(failure.tail) or ("", "see the node output above")
        text = str(LaunchError(text, why, fix))
    print(f"sail launch: {text}", file=sys.stderr, flush=True)
