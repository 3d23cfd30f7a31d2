#!/usr/bin/env bash
# Set up (Python environment and the system packages the cluster tests use), then run the checks CI
# runs: ruff, mypy, the documentation site's build and the whole test suite (extra args go to both of
# pytest's passes).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/install.sh"  # what the Dockerfile's image runs: system packages, pinned environment
cd "$root"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# the docs site: any warning (a broken link or anchor, a reference the generator cannot fill) fails
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
# Two passes: everything but the timing-bound tests on SAIL_TEST_WORKERS pytest-xdist workers (2, the
# cores of a CI machine; 0 runs them in this process), the cluster's tests all on one of them; then the
# `alone` tests, with nothing beside them. A -m EXPR of the caller's narrows both passes; one matrix
# sample for both (SAIL_MATRIX_SEED replays one).
export SAIL_MATRIX_SEED=${SAIL_MATRIX_SEED:-$(.venv/bin/python -c "import random; print(random.SystemRandom().randrange(10**6))")}
workers=${SAIL_TEST_WORKERS:-2}
marks=() rest=()
while [ $# -gt 0 ]; do
  case $1 in
    -m) marks+=("($2)"); shift 2 ;;
    -m*) marks+=("(${1#-m})"); shift ;;
    *) rest+=("$1"); shift ;;
  esac
done
only=""
for mark in "${marks[@]+"${marks[@]}"}"; do only+="$mark and "; done
status=0
.venv/bin/pytest -n "$workers" --dist loadgroup -m "${only}not alone" "${rest[@]+"${rest[@]}"}" || status=$?
alone=0
.venv/bin/pytest -m "${only}alone" "${rest[@]+"${rest[@]}"}" || alone=$?
# 5: no test was selected (a path or -k that names only tests of the other pass)
if [ "$status" = 5 ] && [ "$alone" = 5 ]; then exit 5; fi
[ "$status" = 5 ] && status=0
[ "$alone" = 5 ] && alone=0
exit $((status > alone ? status : alone))
