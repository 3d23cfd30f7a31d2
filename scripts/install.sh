#!/usr/bin/env bash
# Install everything SpikingSail's jobs and tests need on this machine: the system packages
# (scripts/system-deps.sh) and the pinned Python environment with DeepSpeed and Horovod
# (scripts/setup.sh --backends). The Dockerfile's image is built by exactly this script, and
# scripts/test.sh (CI) runs it too, so the image's install steps are tested on every CI run.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/system-deps.sh"  # first: the environment's Horovod build needs the compilers
bash "$root/scripts/setup.sh" --backends
