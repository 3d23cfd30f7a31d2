"""What the programs `sail` hands a job to say of it before they start anything: torchrun (its parser,
its ``run`` up to the launch, its rendezvous handler's reading of the endpoint) and ssh (``ssh -G``
reads every option and prints the result without connecting). The CLI fuzz test holds every
command line `sail` accepts to these, so that nothing accepted is refused later on the nodes."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import subprocess
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch.distributed.run as torchrun
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig

from spikingsail.launchers.command import LaunchCommand


def torchrun_config(args: list[str]) -> LaunchConfig | str:
    """torchrun's launch config for ``args`` (its command line after ``python -m
    torch.distributed.run``), or what torchrun says when it refuses them. torchrun's own ``run`` reads
    them; only ``elastic_launch``, which would start the agent, is replaced by a recorder."""
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            ns = torchrun.get_args_parser().parse_args(args)
        except SystemExit:
            return f"torchrun's parser: {err.getvalue().strip()}"
    launched: list[LaunchConfig] = []

    def record(config: LaunchConfig, entrypoint: Any) -> Callable[..., None]:
        launched.append(config)
        return lambda *_: None

    with mock.patch.object(torchrun, "elastic_launch", record), mock.patch.dict(os.environ):
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # run() sets it in this process otherwise
        try:
            torchrun.run(ns)  # type: ignore[no-untyped-call]
        except (ValueError, RuntimeError, AssertionError) as refused:
            return f"torchrun's run: {refused}"
    (config,) = launched
    try:
        if config.rdzv_backend == "static":  # builds the handler; it connects only at the rendezvous
            create_rdzv_handler(
                RendezvousParameters(
                    "static", config.rdzv_endpoint, config.run_id, config.min_nodes, config.max_nodes,
                    **config.rdzv_configs,
                )
            )  # fmt: skip
        else:  # c10d's handler opens its store at once: its first step is this reading of the endpoint
            parse_rendezvous_endpoint(config.rdzv_endpoint, DEFAULT_PORT)
    except ValueError as refused:
        return f"torchrun's rendezvous: {refused}"
    return config


def torchrun_args(command: LaunchCommand) -> list[str] | None:
    """The arguments a command gives torchrun when it runs it directly (``python -m
    torch.distributed.run ...``), else None."""
    argv = command.argv
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] == "torch.distributed.run":
            return argv[i + 2 :]
    return None


def ssh_refusal(command: LaunchCommand) -> str | None:
    """What ``ssh -G`` says of an ssh command's options (None: it reads them all)."""
    if command.argv[:1] != ["ssh"] or "--" not in command.argv:
        return None
    end = command.argv.index("--")
    options = [a for a in command.argv[1:end] if a != "-tt"]
    host = command.argv[end + 1]
    done = subprocess.run(
        ["ssh", "-G", *options, "--", host],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    return None if done.returncode == 0 else f"{shlex.join(['ssh', '-G', *options])}: {done.stderr.strip()}"
