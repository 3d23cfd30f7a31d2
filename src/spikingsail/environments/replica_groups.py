"""What ``sail launch --ft-replicas`` tells each replica group's processes (torch-free: the
launcher reads it too, and must start without importing torch)."""

from __future__ import annotations

import socket

ENV_GROUP = "REPLICA_GROUP_ID"
ENV_GROUPS = "NUM_REPLICA_GROUPS"
ENV_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
ENV_SECRET = "SAIL_REPLICA_SECRET"  # noqa: S105 - the variable's name, not a secret
"""The job's secret (64 hex digits), which a group's state must be signed with for another to load
it; in the environment only (``/proc/PID/environ`` is the owner's), never on a command line."""
SECRET_BYTES = 32


def address_on_route_to(host: str, port: int) -> str:
    """This machine's address on its route to ``host`` (IPv4): a UDP connect sends nothing, it only
    picks the route. Raises ``OSError`` when there is none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])
