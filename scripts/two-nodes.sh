#!/usr/bin/env bash
# Set up, then run the main job on two nodes: a throwaway cluster of two network namespaces on this
# machine (node1, node2, each with its own sshd), launched with `sail launch -H hostfile` from node1.
# Needs root (it creates the namespaces). Extra arguments go to the training script.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
bash "$root/scripts/system-deps.sh"
cd "$root"
exec .venv/bin/python -m tests.cluster.harness \
  .venv/bin/sail launch -H '{hostfile}' --ssh-config '{ssh_config}' examples/train_digits.py "$@"
