#!/usr/bin/env bash
# Set up (Python environment and the system packages the cluster tests use), then run the checks CI
# runs: ruff, mypy and the whole test suite (extra args go to pytest).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/install.sh"  # what the Dockerfile's image runs: system packages, pinned environment
cd "$root"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
exec .venv/bin/pytest "$@"
