"""Platform mode: the platform starts one container per node and describes the job per node.

SenseCore, Kubeflow's PyTorchJob and similar platforms inject MASTER_ADDR, MASTER_PORT, RANK and
WORLD_SIZE into every node, where RANK is the *node's* rank and WORLD_SIZE the *node count* (what
Lightning calls NODE_RANK and num_nodes). torchrun's workers use the same names per *process*.
``sail launch --nproc-per-node G script.py`` on such a node starts G workers as node RANK of
WORLD_SIZE through torchrun's static rendezvous, so global ranks follow the platform's node order.
``--standalone`` (seed 002's StandAlone) ignores the variables.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from spikingsail.errors import LaunchError

log = logging.getLogger(__name__)
PLATFORM_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def platform_flags(env: Mapping[str, str]) -> list[str] | None:
    """torchrun flags for this node when the platform variables describe a multi-node job."""
    if not all(v in env for v in PLATFORM_VARS) or "TORCHELASTIC_RUN_ID" in env:
        return None
    try:
        node_rank, nodes, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
    except ValueError:
        raise LaunchError(
            "platform variables are not integers: "
            + ", ".join(f"{v}={env[v]!r}" for v in ("RANK", "WORLD_SIZE", "MASTER_PORT")),
            fix="check what the platform injects, or pass --standalone to ignore it",
        ) from None
    if nodes <= 1:
        return None
    if not 0 <= node_rank < nodes:
        raise LaunchError(
            f"platform says this is node RANK={node_rank} of WORLD_SIZE={nodes}",
            "a node rank must be between 0 and the node count - 1",
            "check the platform's job spec, or pass --standalone to ignore the variables",
        )
    log.info("platform mode: node %d of %d, master %s:%d", node_rank, nodes, env["MASTER_ADDR"], port)
    return ["--nnodes", str(nodes), "--node-rank", str(node_rank),
            "--master-addr", env["MASTER_ADDR"], "--master-port", str(port)]  # fmt: skip
