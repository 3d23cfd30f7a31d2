#!/usr/bin/env bash
# Install everything SpikingSail's jobs and tests need on this machine: the system packages
# (scripts/system-deps.sh) and the pinned Python environment with DeepSpeed and Horovod
# (scripts/setup.sh --backends). The Dockerfile's image is built by exactly this script, and
# scripts/test.sh (CI) runs it too, so the image's install steps are tested on every CI run.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Debian's packages install while the Python environment downloads (both wait on the network more
# than on the CPU); setup.sh waits for them before the backends (mpi4py and Horovod's build need
# Open MPI and the compilers), reading the status file they leave.
deps=$(mktemp -d)
trap 'rm -rf "$deps"' EXIT
(code=0; bash "$root/scripts/system-deps.sh" > "$deps/log" 2>&1 || code=$?; echo "$code" > "$deps/tmp" && mv "$deps/tmp" "$deps/status") &
code=0
SAIL_SYSTEM_DEPS="$deps" bash "$root/scripts/setup.sh" --backends || code=$?
wait
cat "$deps/log"
if [ "$code" != 0 ]; then exit "$code"; fi
exit "$(cat "$deps/status")"
