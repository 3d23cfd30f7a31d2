"""The one ninja that compiles DeepSpeed's CPU ops (torch's JIT extensions) in every process the tests
start: the one this run's PATH finds first (scripts/setup.sh built the ops with it), else the
environment's. Two ninja versions read each other's build log as stale and compile everything again
(90-140 s on two cores, each time they alternate), and tests that put the environment's bin/ (which
has a ninja of its own) first on PATH would alternate them. ``NINJA_DIR`` holds only that ``ninja``:
it goes first on PATH (``tests/conftest.py``; tests that put other directories first keep it ahead
of them), so nothing else the tests find changes."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys

_prefix = os.path.realpath(sys.prefix)
_ninja = shutil.which("ninja") or os.path.join(_prefix, "bin", "ninja")
NINJA_DIR = os.path.join(
    _prefix,
    "torch_extensions",
    "ninja-" + hashlib.sha256(_ninja.encode()).hexdigest()[:8],
)
os.makedirs(NINJA_DIR, exist_ok=True)
with contextlib.suppress(FileExistsError):  # the suite's other pytest process made it first
    os.symlink(_ninja, os.path.join(NINJA_DIR, "ninja"))

# DeepSpeed's ops, built once by scripts/setup.sh inside the environment by its real path. Their build
# files record the sources' paths as the interpreter saw them, and another path means a rebuild over
# that build: a run through a link to the environment (``.venv/bin/python -m pytest``) builds its own,
# once, beside it, instead of twice each time it alternates with a run by the real path.
EXTENSIONS_DIR = os.path.join(
    _prefix,
    "torch_extensions"
    if sys.prefix == _prefix
    else "torch_extensions-" + hashlib.sha256(sys.prefix.encode()).hexdigest()[:8],
)
