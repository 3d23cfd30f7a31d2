"""The c10d rendezvous port of a SLURM job's torchrun agents.

A fixed port (torchrun's 29500) makes two jobs whose first node is the same meet in one store: the
second job's agent finds the port taken, joins the first job's store as a client, and dies when the
first job ends. The port is derived from the job id, the way srun tasks derive theirs (one function,
``environments.slurm.job_port``), and when the first node is this machine (an sbatch script runs there) a
taken port is passed over for the next free one.

    python -m spikingsail.launchers.slurm_port FIRST_HOST      (prints the port; sbatch scripts)
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Mapping

from spikingsail.environments.slurm import job_port
from spikingsail.launchers.hostfile import is_this_machine

# SlurmEnvironment's range: clear of common services and of Linux's ephemeral ports.
_FIRST, _COUNT = 15000, 15000
_TRIES = 64


def rendezvous_port(env: Mapping[str, str], first_host: str) -> int:
    # the srun tasks' own derivation, not a copy of it
    port = job_port(env)
    if not is_this_machine(first_host):
        return port  # another node's ports cannot be checked from here
    for step in range(_TRIES):
        candidate = _FIRST + (port - _FIRST + step) % _COUNT
        if _free(candidate):
            return candidate
    return port


def _free(port: int) -> bool:
    """Whether a listening socket could take the port, as the c10d store's does (SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(OSError):
            probe.bind(("", port))
            return True
    return False


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m spikingsail.launchers.slurm_port FIRST_HOST")
    print(rendezvous_port(os.environ, sys.argv[1]))


if __name__ == "__main__":
    main()
