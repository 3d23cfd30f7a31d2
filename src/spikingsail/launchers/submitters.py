"""Where ``sail submit`` sends a job, by name (``--target``): a module each, registered here.

A submitter module has ``parse_submit(argv) -> (request, namespace)``, where the request knows its
``script``, ``script_args``, ``job_name`` and ``world_size`` and ``render()``s the file to submit,
and ``submit(path) -> job id``; ``wait(job_id) -> (state, exit status)`` where it can wait.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from spikingsail.errors import LaunchError


@dataclass(frozen=True, slots=True)
class Target:
    module: str
    suffix: str
    """The written file's default name: JOB_NAME + suffix."""
    local_files: bool
    """The nodes read the files named on the command line where they are here (a shared
    filesystem), so the configs they name are checked here; else they are in an image."""

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


TARGETS: dict[str, Target] = {
    "slurm": Target("spikingsail.launchers.sbatch", ".sbatch", local_files=True),
    "k8s": Target("spikingsail.launchers.k8s", ".pytorchjob.json", local_files=False),
}
DEFAULT = "slurm"


def target_of(argv: list[str]) -> Target:
    """The ``--target`` among the options before the training script (default slurm); read as
    argparse reads them, so that a value or the script's own ``--target`` is never taken for it."""
    takes_value = {
        option
        for target in TARGETS.values()
        for action in target.load().parser()._actions
        if action.nargs != 0
        for option in action.option_strings
    }
    name, index = DEFAULT, 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--target" and index + 1 < len(argv):
            name = argv[index + 1]
        elif arg.startswith("--target="):
            name = arg.partition("=")[2]
        elif not arg.startswith("-") or arg == "--":
            break  # the training script: what follows is its own
        index += 2 if arg in takes_value else 1
    target = TARGETS.get(name)
    if target is None:
        raise LaunchError(
            f"sail submit --target {name!r} is not a target", fix=f"choose one of: {', '.join(TARGETS)}"
        )
    return target
