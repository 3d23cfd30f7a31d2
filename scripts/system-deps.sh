#!/usr/bin/env bash
# Install the system packages the cluster tests run for real (sshd, pdsh, Open MPI, SLURM with munge, iproute2),
# the compilers the Horovod build and DeepSpeed's JIT ops need (g++, cmake), and the headless browser the
# documentation site's test opens it in (chromium), if missing.
# Needs root and Debian's apt; elsewhere it says what is missing and the cluster tests will fail
# with the same message.
set -euo pipefail
packages=(openssh-server openssh-client pdsh openmpi-bin slurm-wlm munge iproute2 iptables util-linux g++ make cmake
          libopenmpi-dev chromium)
commands=(/usr/sbin/sshd ssh pdsh mpirun /usr/sbin/slurmctld /usr/sbin/slurmd srun /usr/sbin/munged ip iptables nsenter unshare
          g++ make cmake mpicxx chromium)
missing=()
for cmd in "${commands[@]}"; do command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd"); done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "[system-deps] missing ${missing[*]}; install: ${packages[*]} (needs root and apt)" >&2
  exit 0
fi
echo "[system-deps] installing ${packages[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
