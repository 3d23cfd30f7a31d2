#!/usr/bin/env bash
# Set up (Python environment and the system packages the cluster tests use), then run the checks CI
# runs: ruff, mypy and the whole test suite (extra args go to pytest).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/system-deps.sh"  # first: the environment's Horovod build needs the compilers
bash "$root/scripts/setup.sh" --backends
cd "$root"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
exec .venv/bin/pytest "$@"
