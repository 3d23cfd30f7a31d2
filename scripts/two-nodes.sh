#!/usr/bin/env bash
# A throwaway cluster of two network namespaces on this machine (node1, node2, each with its own
# sshd), set up, used from node1, and torn down at the end. Needs root (it creates the namespaces).
#   bash scripts/two-nodes.sh [ARGS]          the main job with `sail launch -H hostfile` (ARGS to its script)
#   bash scripts/two-nodes.sh -- CMD...       your own command on node1 ({hostfile}, {ssh_config} replaced)
#   bash scripts/two-nodes.sh --shell         a shell on node1 ($HOSTFILE; ssh node2 works), until you exit
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
bash "$root/scripts/system-deps.sh"
cd "$root"
export PATH="$root/.venv/bin:$PATH"  # sail and the environment's python on node1 too
case "${1:-}" in
  --shell) exec .venv/bin/python -m tests.cluster.harness --shell ;;
  --) shift; exec .venv/bin/python -m tests.cluster.harness -- "$@" ;;
  *) exec .venv/bin/python -m tests.cluster.harness \
       sail launch -H '{hostfile}' --ssh-config '{ssh_config}' examples/train_digits.py "$@" ;;
esac
