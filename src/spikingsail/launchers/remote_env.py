"""The environment shipped to remote nodes: explicit, never the launching shell's whole environment.

In order, later entries winning:

1. variables of the launching shell whose names start with an allowed prefix (``FORWARDED_PREFIXES``,
   e.g. NCCL_*, CUDA_*, OMP_NUM_THREADS, PYTHONPATH, LD_LIBRARY_PATH);
2. ``KEY=VALUE`` lines of ``~/.sail_env`` and then of ``./.sail_env`` (like DeepSpeed's ``.deepspeed_env``);
3. ``--env KEY=VALUE`` flags.

Tokens, keys and anything else in the shell stay on the launching machine.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from spikingsail.errors import LaunchError

FORWARDED_PREFIXES = (
    "NCCL_",
    "CUDA_",
    "GLOO_",
    "TORCH_",
    "TORCHELASTIC_",
    "SAIL_",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "PYTHONPATH",
    "LD_LIBRARY_PATH",
    "LD_PRELOAD",
    "UCX_",
    "FI_",
    "HF_",
    "TOKENIZERS_PARALLELISM",
)
ENV_FILE = ".sail_env"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def explicit_env(assignments: list[str]) -> dict[str, str]:
    """``--env KEY=VALUE`` flags."""
    out: dict[str, str] = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep or not _NAME.match(key):
            raise LaunchError(f"--env {item!r} is not KEY=VALUE", fix="write e.g. --env NCCL_DEBUG=INFO")
        out[key] = value
    return out


def read_env_file(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        key = key.strip()
        if not sep or not _NAME.match(key):
            raise LaunchError(
                f"{path}:{number}: cannot read {raw.strip()!r}",
                f"{ENV_FILE} lines are KEY=VALUE",
                "fix or remove that line",
            )
        out[key] = value.strip().strip("'\"")
    return out


def remote_env(
    explicit: Mapping[str, str],
    shell: Mapping[str, str] | None = None,
    search: tuple[Path, ...] | None = None,
) -> dict[str, str]:
    """The variables every node's agent gets."""
    shell = os.environ if shell is None else shell
    search = (Path.home() / ENV_FILE, Path.cwd() / ENV_FILE) if search is None else search
    env = {k: v for k, v in shell.items() if k.startswith(FORWARDED_PREFIXES)}
    for path in search:
        if path.is_file():
            env.update(read_env_file(path))
    env.update(explicit)
    return env
