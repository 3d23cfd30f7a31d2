#!/usr/bin/env bash
# Build Horovod 0.28.1 (PyTorch; Gloo and Open MPI controllers) against the environment's torch, once
# per machine. MPI is what Horovod's Adasum needs; it builds against Debian's libopenmpi-dev.
#
# Horovod's last release does not build as shipped against current tooling: cmake >= 4 rejects its
# cmake_minimum_required(<3.5), and torch >= 2.1 needs C++17 while Horovod asks for C++14. This
# script fetches the sdist, makes exactly those two changes, builds a wheel and keeps it in the
# cache keyed by Horovod, torch and Python versions, so later runs only install it.
#
#   scripts/build-horovod.sh PYTHON      prints the path of the (cached) wheel on stdout
set -euo pipefail
python=${1:?usage: build-horovod.sh PYTHON}
version=0.28.1
cache=${SPIKINGSAIL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spikingsail}
key=$("$python" -c 'import sys, torch; print(f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}")')
out="$cache/wheels/horovod-$version-$key-gloo-mpi"
if ls "$out"/horovod-*.whl >/dev/null 2>&1; then
  ls "$out"/horovod-*.whl
  exit 0
fi
echo "[horovod] building horovod $version for $key (once per machine: about 7 minutes)" >&2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download --quiet --no-deps --no-binary :all: "horovod==$version" -d "$work" >&2
tar -xzf "$work/horovod-$version.tar.gz" -C "$work"
src="$work/horovod-$version"
sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" || {
  echo "[horovod] the C++ standard patch did not apply; the sdist layout changed" >&2
  exit 1
}
mkdir -p "$work/wheel"
CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
  HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j"$(nproc)" \
  "$python" -m pip wheel --quiet --no-deps --no-build-isolation "$src" -w "$work/wheel" >&2
mkdir -p "$out.tmp"
mv "$work"/wheel/horovod-*.whl "$out.tmp/"
mv "$out.tmp" "$out"
ls "$out"/horovod-*.whl
