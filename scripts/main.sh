#!/usr/bin/env bash
# Set up, then run the main job: distributed training on the bundled digits data, 2 local processes.
# The set-up installs only what the job needs (requirements/main.txt; scripts/setup.sh --main), or
# uses the developer environment of scripts/test.sh where that is already complete.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh" --main
cd "$root"
exec .venv/bin/sail launch -n "${NPROC:-2}" examples/train_digits.py "$@"
