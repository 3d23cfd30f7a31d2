#!/usr/bin/env bash
# Set up (Python environment and the system packages the cluster tests use), then run the checks CI
# runs: ruff, mypy, the documentation site's build and the whole test suite (extra args go to each of
# its pytest runs).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/install.sh"  # what the Dockerfile's image runs: system packages, pinned environment
cd "$root"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# the docs site: any warning (a broken link or anchor, a reference the generator cannot fill) fails
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
# The tests run in two lanes, each a pytest process of its own (the machine's two cores): the namespace
# cluster's tests (they share its one cluster) and those marked lane2 beside all the others; then the
# `alone` tests (heartbeats, stall limits) with no other kind beside them, those marked lane2 in the
# second lane; then the `speed` tests (the ranks' measured speeds) with nothing beside them at all.
# SAIL_TEST_SERIAL=1 runs everything in one pytest process. A -m EXPR of the caller's narrows every run;
# they share one matrix sample (SAIL_MATRIX_SEED replays one).
export SAIL_MATRIX_SEED=${SAIL_MATRIX_SEED:-$(.venv/bin/python -c "import random; print(random.SystemRandom().randrange(10**6))")}
if [ "${SAIL_TEST_SERIAL:-0}" = 1 ]; then exec .venv/bin/pytest "$@"; fi
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
status=0 selected=0
run() {  # run LABEL MARKS: pytest on the tests the marks select, in a scratch directory of its own
  .venv/bin/pytest -p no:cacheprovider --basetemp "$scratch/$1" --junitxml "$scratch/$1.xml" \
    -m "$only$2" "${rest[@]+"${rest[@]}"}"
}
outcome() {  # the worst status so far; 5 (no test selected) only where no run selected any
  if [ "$1" = 5 ]; then return 0; fi
  selected=1
  if [ "$1" -gt "$status" ]; then status=$1; fi
}
scratch=$(mktemp -d)
# What runs and is mounted now: a process, network namespace or mount the tests leave fails the run.
SAIL_SUITE_MARK=$(.venv/bin/python -c "import secrets; print(secrets.token_hex(8))")
export SAIL_SUITE_MARK
.venv/bin/python scripts/suite_check.py snapshot "$scratch/before.json"
started=$(date +%s)
lane2=""
trap 'kill $lane2 2>/dev/null || true; rm -rf "$scratch" 2>/dev/null || true' EXIT
lanes() {  # lanes NAME1 MARKS1 NAME2 MARKS2 TITLE2: two runs side by side, the second's output after the first's
  run "$3" "$4" > "$scratch/$3.log" 2>&1 &
  lane2=$!
  code=0; run "$1" "$2" || code=$?; outcome "$code"
  code=0; wait "$lane2" || code=$?; outcome "$code"; lane2=""
  echo "---- $5, which ran beside the others ----"
  cat "$scratch/$3.log"
}
lanes rest "not cluster and not lane2 and not alone" cluster "(cluster or lane2) and not alone" \
  "the namespace cluster's tests and those marked lane2"
lanes alone "alone and not lane2 and not speed" alone2 "alone and lane2 and not speed" "the alone tests marked lane2"
code=0; run speed "speed" || code=$?; outcome "$code"
.venv/bin/python scripts/suite_check.py slowest "$(($(date +%s) - started))" "$scratch"/{rest,cluster,alone,alone2,speed}.xml
if [ "$selected" = 0 ]; then exit 5; fi
.venv/bin/python scripts/suite_check.py leftovers "$scratch/before.json" || status=$((status > 1 ? status : 1))
exit "$status"
