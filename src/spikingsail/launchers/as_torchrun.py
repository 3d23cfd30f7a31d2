"""Run a plain torchrun script under launchers that are not torchrun (mpirun, srun tasks).

    python -m spikingsail.launchers.as_torchrun train.py ARGS...
    python -m spikingsail.launchers.as_torchrun -m package.module ARGS...   (as torchrun -m)

A script written for torchrun reads RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT (``init_process_group("nccl")`` with env://). mpirun and srun describe the process in
their own variables; this shim reads them through SpikingSail's rank discovery, exports torchrun's
names, and runs the script (or module) as ``__main__``.
"""

from __future__ import annotations

import os
import runpy
import sys

from spikingsail.environments import discover_rank_info
from spikingsail.errors import SailError
from spikingsail.launchers.spec import LaunchRequest


def shimmed(request: LaunchRequest, python_options: list[str] | None = None) -> list[str]:
    """The argv that runs the request's script (or module) through this shim, with the launching Python."""
    module = ["-m"] if request.runs_module else []
    options = python_options or []
    return [sys.executable, *options, "-u", "-m", __name__, *module, request.script, *request.script_args]


def torchrun_variables() -> dict[str, str]:
    info = discover_rank_info()
    variables = {
        "RANK": str(info.rank),
        "LOCAL_RANK": str(info.local_rank),
        "WORLD_SIZE": str(info.world_size),
        "LOCAL_WORLD_SIZE": str(info.local_world_size),
    }
    if info.master_addr and info.master_port is not None:
        variables |= {"MASTER_ADDR": info.master_addr, "MASTER_PORT": str(info.master_port)}
    if info.local_rank > 0 and _one_gpu_visible():
        # One GPU bound to this task (srun --gpus-per-task=1): it is device 0 here, and a script's
        # torch.cuda.set_device(LOCAL_RANK) would ask for a GPU it cannot see.
        variables["LOCAL_RANK"] = "0"
    return variables


def _one_gpu_visible() -> bool:
    import torch  # only here: the shim starts scripts that may never touch CUDA

    return torch.cuda.is_available() and torch.cuda.device_count() == 1


def main() -> None:
    module = sys.argv[1:2] == ["-m"]
    args = sys.argv[2:] if module else sys.argv[1:]
    if not args:
        sys.exit("usage: python -m spikingsail.launchers.as_torchrun [-m MODULE | SCRIPT] [ARGS...]")
    try:
        os.environ.update(torchrun_variables())
    except SailError as err:
        sys.exit(f"sail: {err}")
    sys.argv = args
    if module:
        runpy.run_module(args[0], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
