"""The environment shipped to remote nodes: an allow-list, never the launching shell's whole environment.

In order, later entries winning:

1. variables of the launching shell named in ``FORWARDED_NAMES`` or starting with one of
   ``FORWARDED_PREFIXES`` (NCCL_*, CUDA_*, OMP_NUM_THREADS, PYTHONPATH, HF_HOME, ...), except names
   that look like credentials (``looks_secret``) and per-node device masks (``DEVICE_MASKS``);
2. ``KEY=VALUE`` lines of ``~/.sail_env`` and then of ``./.sail_env`` (like DeepSpeed's ``.deepspeed_env``);
3. ``--env KEY=VALUE`` flags.

Only 2 and 3 can ship a credential or a device mask: the user wrote them down for the nodes.
Values never go on a command line that ``ps`` shows: ssh and pdsh send them over ssh's standard
input into a file only the user can read (``EnvFile``), removed before the agent starts.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from spikingsail.errors import LaunchError

log = logging.getLogger(__name__)

FORWARDED_PREFIXES = ("NCCL_", "CUDA_", "GLOO_", "TORCH_", "TORCHELASTIC_", "SAIL_", "UCX_", "FI_")
FORWARDED_NAMES = frozenset(
    {
        "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH", "LD_LIBRARY_PATH", "LD_PRELOAD",
        "TOKENIZERS_PARALLELISM", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE",
        "HF_DATASETS_OFFLINE", "HF_HUB_ENABLE_HF_TRANSFER", "TRANSFORMERS_OFFLINE",
    }
)  # fmt: skip
# Which devices a process sees is a property of each node (and of each local rank, which torchrun
# and the engine set): the launching shell's value would make every node use its GPU list.
DEVICE_MASKS = frozenset(
    {"CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"}
)
# Tokens, keys, passwords, agent sockets: *TOKEN*, *SECRET*, *PASSWORD*, *_KEY, *_KEY_*, SSH_AUTH_SOCK...
_SECRET = re.compile(
    r"TOKEN|SECRET|PASSW(?:OR)?D|CREDENTIAL|PRIVATE|COOKIE|AUTH|APIKEY|(?:^|_)(?:KEY|PASS|PWD)(?:$|_)"
)
ENV_FILE = ".sail_env"
MASK = "****"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def looks_secret(name: str) -> bool:
    """Whether a variable's name says its value is a credential (never shipped unless asked for)."""
    return _SECRET.search(name.upper()) is not None and name != "PWD"


def masked(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as it may be printed: the values of credential-like names hidden."""
    return {k: MASK if looks_secret(k) else v for k, v in env.items()}


def explicit_env(assignments: list[str], shell: Mapping[str, str] | None = None) -> dict[str, str]:
    """``--env KEY=VALUE`` flags, and ``--env KEY``: this shell's value of KEY, which so never
    appears on a command line, not even sail's own."""
    shell = os.environ if shell is None else shell
    out: dict[str, str] = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if not _NAME.match(key):
            shown = key if not sep else f"{key}={MASK if looks_secret(key) else value}"
            raise LaunchError(
                f"--env {shown!r} is not KEY=VALUE or KEY",
                fix="write e.g. --env NCCL_DEBUG=INFO, or --env HF_TOKEN to ship this shell's value",
            )
        if not sep and key not in shell:
            raise LaunchError(
                f"--env {key}: {key} is not set in this shell",
                "--env NAME ships the launching shell's value of NAME",
                f"export {key} first, or write --env {key}=VALUE",
            )
        out[key] = value if sep else shell[key]
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
    env = {k: v for k, v in shell.items() if _forwarded(k)}
    held = sorted(k for k in DEVICE_MASKS & shell.keys() if k not in explicit)
    if held:
        log.info(
            "not shipping this shell's %s: every node uses its own devices "
            "(pass --env NAME=VALUE to set one on every node)",
            ", ".join(held),
        )
    for path in search:
        if path.is_file():
            env.update(read_env_file(path))
    env.update(explicit)
    return env


def launcher_env(
    names: tuple[str, ...], prefixes: tuple[str, ...] = (), shell: Mapping[str, str] | None = None
) -> dict[str, str]:
    """What a launcher that starts this node's ranks itself (mpirun, horovodrun) needs of this
    shell: ``names`` as they are, and variables with ``prefixes`` (its tuning) that do not look
    like credentials. It runs with only these and the shipped environment, so that the ranks here
    get what the ranks on the other nodes get."""
    shell = os.environ if shell is None else shell
    env = {k: shell[k] for k in names if k in shell}
    return env | {
        k: v for k, v in shell.items() if prefixes and k.startswith(prefixes) and not looks_secret(k)
    }


def _forwarded(name: str) -> bool:
    allowed = name in FORWARDED_NAMES or name.startswith(FORWARDED_PREFIXES)
    return allowed and name not in DEVICE_MASKS and not looks_secret(name)


@dataclass(kw_only=True, slots=True, frozen=True)
class EnvFile:
    """The node's environment in a file only the user can read, written from ssh's standard input.

    The directory name is random (not the rendezvous id, which a user may choose), and ``mkdir``
    fails on anything already there, so no one can prepare the path to read what is written. It
    ends with the node's own name: nodes that share /tmp each get theirs, and the line that reads
    the file is the same for every node (pdsh runs one line on all of them).
    """

    token: str

    @property
    def directory(self) -> str:
        return f'"${{TMPDIR:-/tmp}}/sail-{self.token}-$(uname -n)"'

    def receive(self) -> str:
        """Shell line on the node: standard input → the file."""
        return f"umask 077 && mkdir {self.directory} && cat > {self.directory}/env"

    def source(self) -> str:
        """Shell line on the node: the variables into this shell (exported), then the file gone."""
        return f". {self.directory}/env && rm -rf {self.directory}"

    def remove(self) -> str:
        return f"rm -rf {self.directory}"


def export_lines(env: Mapping[str, str]) -> str:
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(env.items()))
