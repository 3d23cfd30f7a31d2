"""``sail``: one command with subcommands; each subcommand is a small module with ``run(argv)``."""

from __future__ import annotations

import gc
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from spikingsail import __version__
from spikingsail.errors import SailError
from spikingsail.exits import exit_now
from spikingsail.monitor.logs import configure_logging

_USAGE = f"""usage: sail <command> [options]

SpikingSail {__version__}: distributed training of conventional and spiking PyTorch networks.

commands:
  launch     start a training script under torchrun: here (-n 2), on a hostfile's nodes (-H), with
             mpirun, or with srun inside a SLURM allocation
  submit     write an sbatch script (SLURM) or, with --target k8s, a Kubeflow PyTorchJob (Kubernetes)
             for a training script and submit it
  doctor     check this machine (-H: every node of a hostfile) for the set-up mistakes that make
             jobs fail or hang, with a fix for each
  bench      measure things: `sail bench comm` times all-reduce, all-gather and broadcast
  report     draw a run's metrics file: loss, lr, samples/s, each rank's step-time breakdown
  checkpoint list, verify and export a run's checkpoints (export: one .safetensors / .pt state
             dict of the model, whatever backend wrote it)

Run `sail <command> --help` for a command's options.
"""


_COMMANDS = (
    "launch",
    "submit",
    "doctor",
    "bench",
    "report",
    "checkpoint",
)  # each a module of spikingsail.cli


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE, end="")
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"sail {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    configure_logging()
    if command not in _COMMANDS:
        print(f"sail: unknown command {command!r}\n\n{_USAGE}", file=sys.stderr, end="")
        return 2
    try:
        run: Callable[[list[str]], int] = _import_quietly(f"spikingsail.cli.{command}").run
        return run(rest)
    except SailError as err:
        print(f"sail {command}: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (sail report ... | head): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141  # 128 + SIGPIPE, as a shell reports a command a closed pipe stopped


def _import_quietly(name: str) -> Any:
    """``import_module(name)`` with the garbage collector off, then what it built frozen: importing
    torch (which ``launch`` does to read torchrun's flags) allocates a million objects that live as
    long as the command, and the collections that walk them while they are made cost a tenth of the
    import; after it, each full collection walks only what the command made since."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return importlib.import_module(name)
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def entry() -> NoReturn:
    """The ``sail`` command: ``main()``, then ``exit_now`` (no teardown of the modules). An exception
    escaping ``main()`` ends the process as usual."""
    exit_now(main())


if __name__ == "__main__":
    entry()
