"""The per-node torchrun agent command that the ssh and pdsh launchers run on every node."""

from __future__ import annotations

import os
import shlex
import sys
import uuid
from dataclasses import dataclass

from spikingsail.launchers.hostfile import Node
from spikingsail.launchers.request import LaunchRequest


@dataclass(kw_only=True, slots=True, frozen=True)
class Rendezvous:
    endpoint: str
    """host:port of the c10d store, on the first node."""
    run_id: str
    nnodes: int

    @classmethod
    def for_request(cls, request: LaunchRequest, nodes: list[Node]) -> Rendezvous:
        endpoint = request.rdzv_endpoint or f"{nodes[0].host}:{request.master_port}"
        return cls(
            endpoint=endpoint, run_id=request.rdzv_id or f"sail-{uuid.uuid4().hex[:12]}", nnodes=len(nodes)
        )


def agent_argv(request: LaunchRequest, node: Node, rdzv: Rendezvous) -> list[str]:
    """torchrun for one node: same Python, c10d rendezvous on the first node, this node's process count."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(rdzv.nnodes),
        "--nproc-per-node", str(node.nproc),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", rdzv.endpoint,
        "--rdzv-id", rdzv.run_id,
        *request.torchrun_args,
        request.script, *request.script_args,
    ]  # fmt: skip


def node_env(node: Node, shipped: dict[str, str]) -> dict[str, str]:
    env = dict(shipped)
    if node.slots != tuple(range(node.nproc)):
        # --include host:1,3 — the node's processes see only those GPUs, as local ranks 0 and 1.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, node.slots))
    return env


def remote_shell_command(argv: list[str], env: dict[str, str], workdir: str | None = None) -> str:
    """One shell line: same working directory, explicit environment, then exec the agent."""
    workdir = workdir or os.getcwd()
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return f"cd {shlex.quote(workdir)} && exec env {assignments} {shlex.join(argv)}".replace("env  ", "env ")
