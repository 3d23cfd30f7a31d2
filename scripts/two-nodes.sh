#!/usr/bin/env bash
# A throwaway cluster of two network namespaces on this machine (node1, node2, each with its own
# sshd), set up, used from node1, and torn down at the end. Needs root (it creates the namespaces).
#   bash scripts/two-nodes.sh [ARGS]          the main job with `sail launch -H hostfile` (ARGS to its script)
#   bash scripts/two-nodes.sh -- CMD...       your own command on node1, in this directory
#                                             ({hostfile} and {ssh_config} in it are the cluster's files)
#   bash scripts/two-nodes.sh --shell         a shell on node1 ($HOSTFILE; ssh node2 works), until you exit
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
bash "$root/scripts/system-deps.sh"
export PATH="$root/.venv/bin:$PATH"  # sail and the environment's python, on node1 too
harness="$root/tests/cluster/harness.py"
case "${1:-}" in
  --shell) exec python "$harness" --shell ;;
  --) shift; exec python "$harness" -- "$@" ;;
  *) cd "$root" && exec python "$harness" \
       sail launch -H '{hostfile}' --ssh-config '{ssh_config}' examples/train_digits.py "$@" ;;
esac
