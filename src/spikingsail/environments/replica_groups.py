"""What ``sail launch --ft-replicas`` tells each replica group's processes (torch-free: the
launcher reads it too, and must start without importing torch)."""

from __future__ import annotations

import socket

ENV_GROUP = "REPLICA_GROUP_ID"
ENV_GROUPS = "NUM_REPLICA_GROUPS"
ENV_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"


def address_on_route_to(host: str, port: int) -> str:
    """This machine's address on its route to ``host`` (IPv4): a UDP connect sends nothing, it only
    picks the route. Raises ``OSError`` when there is none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])
