"""What every launcher is: its facts, its own checks of a request, and the commands it runs.

A launcher is one small class in a file of its own, registered by name in ``launchers/__init__.py``.
The command line's parser (``request``), ``sail launch`` (``run``) and the failure report
(``failure``) ask the launcher; none of them knows a launcher by its name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.spec import LaunchRequest
from spikingsail.launchers.torchrun_args import TorchrunArgs


class Launcher(ABC):
    name: ClassVar[str]
    """``--launcher NAME``."""
    needs_hosts: ClassVar[bool] = True
    """The launch needs ``-H``: it starts processes on the hosts named there."""
    here_without_hosts: ClassVar[bool] = False
    """Without ``-H``, ``--launcher NAME`` runs every process on this machine (``-np``, else
    ``--nproc-per-node``), as the launcher's own command does."""
    agent_signals: ClassVar[bool] = True
    """The job's ranks are started by torchrun's agents, which pass on only the signals they are
    told to handle: they get ``--signals-to-handle`` with every signal in ``command.FORWARDED``.
    False: the launcher passes those signals on itself (``LaunchCommand.relay`` and ``stand_ins``)."""
    install_hint: ClassVar[str] = ""
    """How to install what ``exists`` looks for."""
    dist_init_methods: ClassVar[tuple[str, ...]] = ("torchrun",)
    """The ``--dist-init-method`` values it can start (``slurm``: one srun task per process)."""
    hosts_replica_groups: ClassVar[bool] = False
    """``--ft-replicas`` with ``-H``: sail launch starts each replica group's torchrun agents on the
    group's nodes through it."""
    agents_here: ClassVar[bool] = False
    """Without ``-H``, torchrun's agent runs on this machine, started by sail launch itself: the
    process count is its flags' (``gpu``: this machine's GPUs), and replica groups run here."""
    world_from_scheduler: ClassVar[bool] = False
    """The job's size is the scheduler's allocation's, not the command line's (srun)."""
    supervised: ClassVar[bool] = True
    """Its commands run under ``supervisor.supervise``, after every host was reached over ssh.
    False: its one command runs on this machine, in this terminal (``local.run_local``)."""

    @staticmethod
    def exists() -> bool:
        """Whether the program it runs is installed here."""
        return True

    def check(self, env: Mapping[str, str]) -> None:
        """Refuse, while the command line is read, a launch it cannot start from here (``env``:
        this process's environment)."""

    def torchrun_flags(self, args: TorchrunArgs, env: Mapping[str, str]) -> list[str]:
        """The user's torchrun flags that every agent gets: all but those the launcher sets for
        every node itself (the node count, the process count, the rendezvous)."""
        return args.without_per_node()

    @abstractmethod
    def commands(self, request: LaunchRequest) -> list[LaunchCommand]:
        """The job's commands, before anything runs; refuses a request it cannot honour."""

    def probe_hosts(self, request: LaunchRequest) -> list[str]:
        """The hosts that the job's commands reach over ssh, each checked before anything starts."""
        return [node.host for node in request.nodes or []]

    @staticmethod
    def read_failure(text: str, tail: list[str], exit_code: int) -> tuple[str, list[str]] | None:
        """The failed rank in the launcher's own report of it in ``text`` (its output's last lines,
        ``tail``, joined), and the lines that rank printed; None where ``text`` has no such report
        (torchrun's failure summary, which every agent prints, is read in ``failure``)."""
        return None
