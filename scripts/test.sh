#!/usr/bin/env bash
# Set up (Python environment and the system packages the cluster tests use), then run the checks CI
# runs: ruff, mypy, the documentation site's build and the whole test suite (extra args go to pytest).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/install.sh"  # what the Dockerfile's image runs: system packages, pinned environment
cd "$root"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# the docs site: any warning (a broken link or anchor, a reference the generator cannot fill) fails
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
exec .venv/bin/pytest "$@"
