#!/usr/bin/env bash
# Set up (Python environment and the system packages the cluster tests use), then run the checks CI
# runs: ruff, mypy, the documentation site's build and the whole test suite (extra args go to each of
# its pytest runs).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# What the Dockerfile's image runs (system packages, pinned environment), except that a Horovod not yet
# built on this machine (3 minutes of both cores) is built beside the first phase's tests, below.
later=1
if [ "${SAIL_TEST_SERIAL:-0}" = 1 ]; then later=0; fi
SAIL_HOROVOD_LATER=$later bash "$root/scripts/install.sh"
cd "$root"
# The checkout's bytecode, as setup.sh writes the environment's: a fresh clone has none, and where
# PYTHONDONTWRITEBYTECODE is set, every process the tests start would compile what it imports of it.
.venv/bin/python -m compileall -q -q src tests || true
lint() {  # ruff, mypy and the docs site (any warning fails: a broken link or anchor, an unfilled reference)
  .venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy &&
    NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
}
# The tests run in lanes, each a pytest process of its own, that share out the tests as they go
# (tests/lanes.py: a lane claims each test file, or each test, before running it). First two lanes
# on the machine's two cores, the lint beside them: the namespace cluster's tests (one cluster) run in
# the second lane, before it joins the first in the others. Then the `alone` tests (heartbeats, stall
# limits) with no other kind beside them, in three lanes that share them test by test (they mostly
# wait; the cluster's again in one lane); then the `speed` tests (the ranks' measured speeds) with
# nothing beside them at all.
# SAIL_TEST_SERIAL=1 runs the lint, then everything in one pytest process. A -m EXPR of the caller's
# narrows every run; they share one matrix sample (SAIL_MATRIX_SEED replays one).
export SAIL_MATRIX_SEED=${SAIL_MATRIX_SEED:-$(.venv/bin/python -c "import random; print(random.SystemRandom().randrange(10**6))")}
if [ "${SAIL_TEST_SERIAL:-0}" = 1 ]; then lint; exec .venv/bin/pytest "$@"; fi
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
cpu_groups=/sys/fs/cgroup/cpuacct/sail-suite  # each lane's cpuacct group: its tests' CPU time (tests/cpu_time.py)
run() {  # run LABEL MARKS: pytest on the tests the marks select, in a scratch directory of its own
  local group=$cpu_groups-$SAIL_SUITE_MARK-$1
  (
    if mkdir "$group" 2>/dev/null; then echo "$BASHPID" > "$group/cgroup.procs"; fi
    exec .venv/bin/pytest -p no:cacheprovider --basetemp "$scratch/$1" --junitxml "$scratch/$1.xml" \
      -m "$only$2" "${rest[@]+"${rest[@]}"}" "${files[@]+"${files[@]}"}"
  )
}
outcome() {  # the worst status so far; 5 (no test selected) only where no run selected any
  if [ "$1" = 5 ]; then return 0; fi
  selected=1
  if [ "$1" -gt "$status" ]; then status=$1; fi
}
# DeepSpeed's ops built by the ninja the tests use (an environment another ninja built them in gets
# them compiled again here, once, not inside a test that would time out waiting for it)
bash scripts/deepspeed-ops.sh "$(cd .venv && pwd -P)"
scratch=$(mktemp -d)
# What runs, is mounted and is in /dev/shm now: a process, network namespace, mount or shared memory
# the tests leave fails the run.
SAIL_SUITE_MARK=$(.venv/bin/python -c "import secrets; print(secrets.token_hex(8))")
export SAIL_SUITE_MARK
.venv/bin/python scripts/suite_check.py snapshot "$scratch/before.json"
export SAIL_TEST_CPU_TIME=1
started=$(date +%s)
beside="" horovod=""
trap 'kill $beside 2>/dev/null || true; if [ -n "$horovod" ]; then kill -- "-$horovod" 2>/dev/null || true; fi
      rm -rf "$scratch" 2>/dev/null || true; rmdir "$cpu_groups-$SAIL_SUITE_MARK"-* 2>/dev/null || true' EXIT
if [ ! -f "$(cd .venv && pwd -P)/.backends-complete" ]; then
  # Horovod's build, in a process group of its own and at a lower priority than the tests: it takes
  # the cores they leave idle (they wait on processes and sockets a tenth of the time). A test that
  # needs Horovod (marked `horovod`, tests/horovod_build.py) waits for it, and the `alone` phase starts
  # after it. The status file holds the build's exit status once it has ended.
  export SAIL_TEST_HOROVOD_STATUS=$scratch/horovod.status
  setsid bash -c 'code=0; nice -n 10 bash scripts/setup.sh --horovod > "$1.log" 2>&1 || code=$?
                  echo "$code" > "$1.tmp" && mv "$1.tmp" "$1"' - "$SAIL_TEST_HOROVOD_STATUS" &
  horovod=$!
fi
lanes() {  # lanes NAME MARKS [NAME MARKS ...]: runs side by side, each later one's output after the first's
  local first=$1 marks=$2 name pids=()
  shift 2
  beside=""
  while [ $# -gt 0 ]; do
    if [ "$1" = lint ]; then lint > "$scratch/lint.log" 2>&1 & else run "$1" "$2" > "$scratch/$1.log" 2>&1 & fi
    pids+=("$1:$!"); beside+=" $!"; shift 2
  done
  code=0; run "$first" "$marks" || code=$?; outcome "$code"
  for name in "${pids[@]}"; do
    code=0; wait "${name#*:}" || code=$?
    echo "---- ${name%%:*}, which ran beside ${first} ----"
    cat "$scratch/${name%%:*}.log"
    if [ "${name%%:*}" = lint ]; then
      if [ "$code" != 0 ]; then echo "the lint failed (exit status $code)"; status=1; fi
    else outcome "$code"; fi
  done
  beside=""
}
share() {  # share BY: the next phase's lanes share their tests by file or by test
  export SAIL_TEST_SHARE_BY=$1 SAIL_TEST_SHARE
  SAIL_TEST_SHARE=$(mktemp -d "$scratch/share-XXXX")
}
share file
# The first phase's lanes collect every test; they write the files that hold the later phases' tests
# (tests/lanes.py), which those phases' lanes then collect alone, unless the caller named paths.
files=() SAIL_TEST_LATER=$scratch/later
export SAIL_TEST_LATER
lanes rest "not cluster and not alone" cluster "not alone" lint -
if [ -n "$horovod" ]; then  # the build beside the first phase: ended before the timing-bound tests
  wait "$horovod" || true
  horovod=""
  if [ "$(cat "$SAIL_TEST_HOROVOD_STATUS" 2>/dev/null)" != 0 ]; then
    echo "---- Horovod's build beside the tests failed; its output:"
    tail -n 40 "$SAIL_TEST_HOROVOD_STATUS.log"
    status=1
  fi
fi
unset SAIL_TEST_LATER
named=0
for arg in "${rest[@]+"${rest[@]}"}"; do if [ -e "${arg%%::*}" ]; then named=1; fi; done
if [ "$named" = 0 ] && [ -s "$scratch/later" ]; then mapfile -t files < "$scratch/later"; fi
share test
lanes alone "alone and not speed" alone2 "alone and not cluster and not speed" \
  alone3 "alone and not cluster and not speed"
unset SAIL_TEST_SHARE SAIL_TEST_SHARE_BY
code=0; run speed "speed" || code=$?; outcome "$code"
.venv/bin/python scripts/suite_check.py slowest "$(($(date +%s) - started))" "$scratch"/{rest,cluster,alone,alone2,alone3,speed}.xml
if [ -n "${SAIL_TEST_REPORTS:-}" ]; then  # keep the lanes' JUnit reports (each test's time and CPU-s)
  mkdir -p "$SAIL_TEST_REPORTS" && cp "$scratch"/*.xml "$SAIL_TEST_REPORTS"/ 2>/dev/null || true
fi
if [ "$selected" = 0 ] && [ "$status" = 0 ]; then exit 5; fi  # the lint may have failed
.venv/bin/python scripts/suite_check.py leftovers "$scratch/before.json" || status=$((status > 1 ? status : 1))
exit "$status"
