"""``sail doctor -H``: probe every node at once, then check what the nodes must agree on.

Every node is reached the way `sail launch` reaches it (ssh in BatchMode, the same options, Python,
working directory and shipped environment). The first node also holds the rendezvous port open
while the other nodes try to connect to it, so "free" and "reachable" are measured, not guessed;
it lets the port go as soon as the other nodes' probes are done.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from spikingsail.diagnostics.collect import ProbeResult, run_on
from spikingsail.diagnostics.findings import Finding, Report, Status, fail, ok, warn
from spikingsail.diagnostics.machine import machine_findings
from spikingsail.launchers.hostfile import Node
from spikingsail.launchers.remote_env import remote_env
from spikingsail.launchers.request import LaunchRequest

Facts = dict[str, Any]
CLOCK_WARN_SECONDS = 1.0
BALANCE_WARN_RATIO = 1.1
"""Ranks whose speeds differ by more than this are worth balancing (`sail.balance`)."""
# Differences that break a job (a mismatch in these fails), and those that only may.
_MUST_MATCH = ("Python", "torch", "CUDA", "NCCL", "spikingsail")
_VERSIONS: dict[str, Callable[[Facts], Any]] = {
    "Python": lambda f: f["python"]["version"],
    "torch": lambda f: f["torch"].get("version") or f["packages"].get("torch"),
    "CUDA": lambda f: f["torch"].get("cuda"),
    "cuDNN": lambda f: f["torch"].get("cudnn"),
    "NCCL": lambda f: f["torch"].get("nccl"),
    "spikingsail": lambda f: f["packages"].get("spikingsail"),
    "numpy": lambda f: f["packages"].get("numpy"),
    "deepspeed": lambda f: f["packages"].get("deepspeed"),
    "horovod": lambda f: f["packages"].get("horovod"),
    "mpi4py": lambda f: f["packages"].get("mpi4py"),
    "spikingjelly": lambda f: f["packages"].get("spikingjelly"),
}


def rendezvous(request: LaunchRequest) -> tuple[str, int]:
    assert request.nodes, "sail doctor -H parses hosts before probing them"
    if request.rdzv_endpoint:
        host, _, port = request.rdzv_endpoint.rpartition(":")
        return host, int(port or request.master_port)
    return request.nodes[0].host, request.master_port


def probe_nodes(request: LaunchRequest, timeout: float) -> list[ProbeResult]:
    """Every node in parallel; the first holds the rendezvous port while the others connect."""
    assert request.nodes, "sail doctor -H parses hosts before probing them"
    host, port = rendezvous(request)
    others = len(request.nodes) - 1
    wait = min(timeout / 4, 10.0)  # peers reach a free port at once; a firewall makes them wait it out
    env = remote_env(request.env)

    peers_done = threading.Event()
    pending = [others]
    lock = threading.Lock()

    def probe(index: int) -> ProbeResult:
        node = request.nodes[index]  # type: ignore[index]
        if index == 0:
            args = ["--port", str(port), "--expect", str(others), "--listen-seconds", str(wait + 5)]
            return run_on(node.host, request.ssh, env, [*args, "--stop-on-eof"], timeout, hold=peers_done)
        try:
            return run_on(node.host, request.ssh, env, ["--connect", f"{host}:{port}", "--connect-seconds",
                                                         str(wait)], timeout)  # fmt: skip
        finally:
            with lock:
                pending[0] -= 1
                if pending[0] == 0:
                    peers_done.set()

    if not others:
        peers_done.set()
    try:
        with ThreadPoolExecutor(max_workers=min(32, len(request.nodes))) as pool:
            return list(pool.map(probe, range(len(request.nodes))))
    finally:
        peers_done.set()


def node_report(request: LaunchRequest, here: Facts, results: list[ProbeResult], report: Report) -> None:
    assert request.nodes, "sail doctor -H parses hosts before probing them"
    nodes = {n.host: n for n in request.nodes}
    reached = [r for r in results if r.facts is not None]
    for result in results:
        report.findings += _reach(result, nodes[result.host])
    if not reached:
        return
    facts = {r.host: r.facts for r in reached if r.facts is not None}
    report.facts.update({"this machine": here, **facts})
    report.findings += _versions(here, facts, report)
    report.findings += [_slots(nodes[h], f) for h, f in facts.items()]
    report.findings.append(_precision(facts))
    report.findings.append(_balance([nodes[h] for h in facts], facts))
    report.findings += _port(request, results)
    report.findings += [_clock(r) for r in reached]


def _reach(result: ProbeResult, node: Node) -> list[Finding]:
    if result.facts is None:
        check = "ssh" if result.ssh_failed else "probe"
        return [Finding(check=check, status=Status.FAIL, detail=result.why, fix=result.fix, host=result.host)]
    # the launching machine's DeepSpeed op table is shown; the nodes' versions are compared instead
    local = machine_findings(result.facts, Report(), host=result.host, nproc=node.nproc)
    problems = [f for f in local if f.status is not Status.OK]
    return [ok("ssh", "BatchMode login works; the probe ran", result.host), *problems]


def _versions(here: Facts, facts: dict[str, Facts], report: Report) -> list[Finding]:
    rows, found = [], []
    for name, read in _VERSIONS.items():
        mine = str(read(here))
        theirs = {host: str(read(f)) for host, f in facts.items()}
        differ = [h for h, v in theirs.items() if v != mine]
        if not differ:
            continue
        rows.append([name, mine, *theirs.values()])
        status = fail if name in _MUST_MATCH else warn
        for host in differ:
            found.append(status("versions", f"{name} {theirs[host]} on {host}, {mine} on this machine",
                                f"install {name} {mine} on {host} (one image or requirements file for all nodes)",
                                host))  # fmt: skip
    if rows:
        report.tables["Versions that differ between nodes"] = [["", "this machine", *facts], *rows]
        return found
    return [ok("versions", f"{', '.join(_VERSIONS)}: the same on all {len(facts)} node(s) and this machine")]


def _gpu_node(facts: Facts) -> bool:
    """Whether the node's processes are meant for GPUs: torch sees some, or the driver or the PCI bus
    shows NVIDIA GPUs; a GPU build of torch on a machine whose PCI bus has none (read from sysfs)
    trains on the CPU."""
    torch, driver = facts["torch"], facts["driver"]
    if torch.get("gpus") or driver.get("gpus") or driver.get("version") or driver.get("pci_gpus"):
        return True
    return bool(torch.get("cuda") or torch.get("hip")) and driver.get("pci_gpus") is None


def _slots(node: Node, facts: Facts) -> Finding:
    torch = facts["torch"]
    if _gpu_node(facts):
        gpus = len(torch.get("gpus") or [])
        chosen = node.slots != tuple(range(node.nproc))  # --include HOST:SLOTS
        missing = [slot for slot in node.slots if slot >= gpus]
        if chosen and missing and gpus:
            return fail("slots", f"slot(s) {','.join(map(str, missing))} chosen, but the node has GPUs 0-{gpus - 1} "
                        "only: those processes would see no GPU and train on the CPU",
                        f"choose slots from 0 to {gpus - 1} for {node.host} (--include {node.host}:0,1)",
                        node.host)  # fmt: skip
        if gpus < node.nproc:
            return fail("slots", f"{node.nproc} process(es) but {gpus} GPU(s) visible",
                        f"give {node.host} slots={gpus} in the hostfile (or --num_gpus {gpus})", node.host)  # fmt: skip
        return ok("slots", f"{node.nproc} process(es), {gpus} GPU(s)", node.host)
    cores = facts["cpus"]["usable"]
    if cores < node.nproc:
        return warn("slots", f"{node.nproc} process(es) but {cores} usable CPU core(s) and no GPU: the "
                    "processes share cores and every step waits for the slowest",
                    f"give {node.host} slots={cores} in the hostfile (or --nproc-per-node {cores})", node.host)  # fmt: skip
    return ok("slots", f"{node.nproc} process(es), {cores} CPU core(s), no GPU", node.host)


def _precision(facts: dict[str, Facts]) -> Finding:
    no_bf16 = {
        host: ", ".join(
            f"{g['name']} (compute {g['capability']})" for g in f["torch"]["gpus"] if not g["bf16"]
        )
        for host, f in facts.items()
        if any(not g["bf16"] for g in f["torch"].get("gpus") or [])
    }
    if no_bf16:
        which = "; ".join(f"{h}: {gpus}" for h, gpus in no_bf16.items())
        return warn("precision", f"bf16 is not supported on {which}",
                    'use "fp16": {"enabled": true} for the whole job, not bf16')  # fmt: skip
    if any(f["torch"].get("gpus") for f in facts.values()):
        return ok("precision", "every GPU supports bf16 and fp16: bf16 needs no loss scaling")
    return ok("precision", "CPU nodes: fp32, or bf16/fp16 autocast (slower than fp32 on most CPUs)")


def _balance(nodes: list[Node], facts: dict[str, Facts]) -> Finding:
    """Weights for `sail.balance` when the ranks are of unequal speed: each GPU's measured fp16
    matmul rate, or on CPU nodes the usable cores each process gets."""
    speeds: dict[str, list[float]] = {}
    units = set()
    for node in nodes:
        gpus = facts[node.host]["torch"].get("gpus") or []
        if gpus:
            units.add("TFLOP/s (fp16 matmul)")
            measured = [float(gpus[s].get("tflops") or 0) if s < len(gpus) else 0.0 for s in node.slots]
            if not all(measured):
                return ok(
                    "balance", f"no weights suggested: a GPU's speed on {node.host} could not be measured"
                )
            speeds[node.host] = measured
        else:
            units.add("core(s) per process")
            speeds[node.host] = [facts[node.host]["cpus"]["usable"] / node.nproc] * node.nproc
    if len(units) != 1:
        return ok("balance", "no weights suggested: GPU and CPU nodes in one job")
    (unit,) = units
    slowest, fastest = min(min(per) for per in speeds.values()), max(max(per) for per in speeds.values())
    shown = ", ".join(f"{host} {'/'.join(f'{s:g}' for s in per)}" for host, per in speeds.items())
    if fastest <= BALANCE_WARN_RATIO * slowest:
        return ok("balance", f"the ranks are about equally fast ({shown} {unit}): balance is not needed")
    weights = {host: [round(s / slowest, 2) for s in per] for host, per in speeds.items()}
    names = {
        node.host: str(facts[node.host].get("host") or node.host) for node in nodes
    }  # as the engine sees it
    if all(len(set(w)) == 1 for w in weights.values()):
        suggestion = json.dumps({names[host]: w[0] for host, w in weights.items()})
    else:  # unequal GPUs inside a node: one weight per rank, in rank order
        suggestion = json.dumps([x for w in weights.values() for x in w])
    return warn("balance", f"ranks of unequal speed ({shown} {unit}): with equal micro-batches every "
                "step waits for the slowest",
                f'set "sail": {{"balance": {suggestion}}} in the config (weights from these speeds), or '
                '"balance": "auto" to measure them while training; the result is the same training')  # fmt: skip


def _port(request: LaunchRequest, results: list[ProbeResult]) -> list[Finding]:
    host, port = rendezvous(request)
    first = results[0]
    out: list[Finding] = []
    if first.facts is not None and first.facts.get("port"):
        state = first.facts["port"]
        if state["free"]:
            out.append(ok("rendezvous port", f"{port} is free on {first.host}", first.host))
        else:
            out.append(fail("rendezvous port", f"{port} on {first.host} cannot be bound ({state['error']}): "
                            "another process holds it",
                            f"stop it (ss -ltnp 'sport = :{port}' shows which) or pass --master-port "
                            "with a free port", first.host))  # fmt: skip
    for result in results[1:]:
        if result.facts is not None and result.facts.get("connect"):
            out.append(_reachable(result.host, host, port, result.facts["connect"], request))
    return out


def _reachable(node: str, host: str, port: int, state: Facts, request: LaunchRequest) -> Finding:
    where = f"{host}:{port}"
    if state["ok"]:
        address = state["address"]
        if address.startswith("127.") and request.nodes and node != request.nodes[0].host:
            return fail("rendezvous port", f"{node} resolves {host} to {address}, its own loopback",
                        f"map {host} to its network address in /etc/hosts on {node}", node)  # fmt: skip
        return ok("rendezvous port", f"{where} ({address}) is reachable", node)
    reasons = {
        "unresolved": (f"{host} does not resolve on {node}", f"add {host} to /etc/hosts or DNS on {node}"),
        "timeout": (f"{where} does not answer from {node}: a firewall drops the packets",
                    f"open TCP port {port} on {host} to the other nodes (iptables/firewalld/security group)"),
        "ECONNREFUSED": (f"{where} refuses connections from {node}: a firewall rejects them, or "
                         f"{host} listens on another interface",
                         f"open TCP port {port} on {host} to the other nodes"),
    }  # fmt: skip
    why, fix = reasons.get(state["error"], (f"{where} is not reachable from {node} ({state['error']})",
                                            "check the network between the nodes"))  # fmt: skip
    return fail("rendezvous port", why, fix, node)


def _clock(result: ProbeResult) -> Finding:
    assert result.facts is not None
    skew = result.facts["time"] - result.received
    if abs(skew) > CLOCK_WARN_SECONDS:
        return warn("clock", f"{skew:+.1f} s from this machine's clock: logs and timeouts disagree across nodes",
                    "synchronise clocks with NTP (chrony or systemd-timesyncd) on every node", result.host)  # fmt: skip
    return ok("clock", f"within {CLOCK_WARN_SECONDS:.0f} s of this machine ({skew:+.2f} s)", result.host)
