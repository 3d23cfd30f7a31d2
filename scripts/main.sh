#!/usr/bin/env bash
# Set up, then run the main job: distributed training on the bundled digits data, 2 local processes.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
cd "$root"
exec .venv/bin/sail launch -n "${NPROC:-2}" examples/train_digits.py "$@"
