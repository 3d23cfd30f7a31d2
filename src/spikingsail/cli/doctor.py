"""``sail doctor``: this machine's set-up, or (``-H``) every node's and what they must agree on.

Every finding has a status (ok / warn / fail) and a one-line fix; the exit status is 1 when
anything fails. The last check is a real all-reduce started the way `sail launch` starts a job.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from spikingsail.diagnostics.collect import run_here
from spikingsail.diagnostics.findings import Finding, Report, Status, fail, ok, use_color
from spikingsail.diagnostics.machine import machine_findings
from spikingsail.launchers.spec import check_seconds
from spikingsail.launchers.torchrun_args import names_hosts

if TYPE_CHECKING:
    from spikingsail.launchers.request import LaunchRequest

ALLREDUCE = "spikingsail.diagnostics.allreduce"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sail doctor",
        description="Check this machine, or with -H every node of a hostfile, for the set-up mistakes "
        "that make distributed jobs fail or hang. Other flags are `sail launch`'s (-n, -H, --ssh-port, "
        "--ssh-config, --launcher pdsh, --master-port, --include, ...) and mean the same.",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto", help="colour the table")
    p.add_argument(
        "--timeout", type=float, default=120.0, help="seconds for each node's checks and for the all-reduce"
    )
    return p


def run(argv: list[str]) -> int:
    args, launch_flags = parse(argv)
    report = Report()
    if names_hosts(launch_flags):
        _nodes(launch_flags, report, args.timeout)
    else:
        _here(launch_flags, report, args.timeout)
    if args.json:
        print(report.to_json())
    else:
        report.render(sys.stdout, use_color(sys.stdout, args.color))
    return 1 if report.failed else 0


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The doctor's own options, checked, and the `sail launch` flags (read by ``job``)."""
    args, launch_flags = parser().parse_known_args(argv)
    check_seconds(
        "--timeout", args.timeout, 0, "give the seconds each check may take, e.g. 120 (the default)"
    )
    return args, launch_flags


def job(launch_flags: list[str]) -> LaunchRequest:
    """The all-reduce job, as `sail launch` reads its flags: a mistake in them stops here, before
    any process or ssh connection starts. Imports torch."""
    from spikingsail.launchers.request import parse_request, with_default_nproc

    flags = launch_flags if names_hosts(launch_flags) else with_default_nproc(launch_flags, 2)
    return parse_request([*flags, "-m", ALLREDUCE])


def _here(launch_flags: list[str], report: Report, timeout: float) -> None:
    here = run_here([], timeout)
    if here.facts is None:
        report.findings.append(fail("python", here.why, here.fix))
        return
    report.facts["this machine"] = here.facts
    if here.facts["torch"].get("error"):
        # nothing below may import torch: the report must still be written
        report.findings += machine_findings(here.facts, report, nproc=2)
        report.findings.append(fail("all-reduce", "not tried: torch does not import", "fix torch first"))
        return
    request = job(launch_flags)
    nproc = int(request.nproc_per_node) if request.nproc_per_node.isdigit() else 1
    report.findings += machine_findings(here.facts, report, nproc=nproc)
    report.findings.append(_allreduce(request, timeout))


def _nodes(launch_flags: list[str], report: Report, timeout: float) -> None:
    from spikingsail.diagnostics.nodes import node_report, probe_nodes

    request = job(launch_flags)  # a bad hostfile stops here, before any ssh
    with ThreadPoolExecutor(max_workers=1) as pool:
        reference = pool.submit(run_here, [], timeout)
        results = probe_nodes(request, timeout)
        here = reference.result()
    if here.facts is None:
        report.findings.append(fail("python", f"on this machine: {here.why}", here.fix))
        return
    node_report(request, here.facts, results, report)
    blocking = {"ssh", "probe", "torch", "rendezvous port", "python"}
    if any(f.status is Status.FAIL and f.check in blocking for f in report.findings):
        report.findings.append(
            fail(
                "all-reduce",
                "not tried: a node cannot run the job (see above)",
                "fix the failures above first",
            )
        )
    else:
        report.findings.append(_allreduce(request, timeout))


def _allreduce(request: LaunchRequest, timeout: float) -> Finding:
    from spikingsail.diagnostics.allreduce import MARKER
    from spikingsail.launchers import plan
    from spikingsail.launchers.supervisor import supervise

    lines: list[str] = []
    status, failure = supervise(plan(request), output=lines.append, timeout=timeout)
    found = [line.split(MARKER, 1)[1] for line in lines if MARKER in line]
    if status == 0 and found:
        result = json.loads(found[-1])
        hosts = sorted(set(result["hosts"]))
        return ok(
            "all-reduce",
            f"{result['world_size']} processes on {', '.join(hosts)} formed a {result['backend']} group "
            f"through {request.launcher} and all-reduced 1 MiB correctly ({result['seconds']:.1f} s)",
        )
    detail = failure.describe() if failure else f"the job exited {status} without a result"
    return fail(
        "all-reduce",
        f"through {request.launcher}: {detail}",
        "the job's last lines are above; across nodes check GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME and "
        "firewalls",
    )
