#!/usr/bin/env bash
# Build Horovod 0.28.1 (PyTorch; Gloo and Open MPI controllers) against the environment's torch, once
# per machine. MPI is what Horovod's Adasum needs; it builds against Debian's libopenmpi-dev.
#
# Horovod's last release does not build as shipped against current tooling: cmake >= 4 rejects its
# cmake_minimum_required(<3.5), and torch 2.14's headers need C++20 while Horovod asks for C++14. This
# script fetches the sdist, makes those two changes (and builds without debug information, below),
# builds a wheel and keeps it in the cache keyed by Horovod, torch and Python versions, so later runs
# only install it.
#
# A CUDA build of torch (what GPU clusters install, and what requirements/dev.txt pins) makes Horovod's
# torch extension link the CUDA runtime even for a CPU-only Horovod: the CUDA toolkit is looked for in
# CUDA_HOME, else /usr/local/cuda.
#
# GPU operations: with a CUDA build of torch and nvcc on PATH (a GPU node's set-up), Horovod is built
# with NCCL (HOROVOD_GPU_OPERATIONS=NCCL), so that the horovod backend all-reduces on the GPUs; else
# CPU-only (gloo and MPI). SAIL_HOROVOD_GPU=nccl or =none decides instead; HOROVOD_NCCL_HOME, when
# set, tells Horovod where NCCL is; else the NCCL that torch's wheel carries (nvidia/nccl) is used.
# The choice is part of the cache key.
#
#   scripts/build-horovod.sh PYTHON      prints the path of the (cached) wheel on stdout
#   scripts/build-horovod.sh --key PYTHON   prints only the cache key (torch, Python, GPU operations)
#   scripts/build-horovod.sh --cached PYTHON   prints the cached wheel's path; exits 1 when none is built
set -euo pipefail
key_only=false cached_only=false
if [ "${1:-}" = "--key" ]; then key_only=true; shift; fi
if [ "${1:-}" = "--cached" ]; then cached_only=true; shift; fi
python=${1:?usage: build-horovod.sh [--key] PYTHON}
version=0.28.1
cache=${SPIKINGSAIL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spikingsail}
# torch's facts, read in one import of it (about 2 CPU-s each): its CUDA version (empty for a CPU build),
# the cache key's torch and Python part, and the GPU architectures torch's own kernels are built for
facts=$("$python" -c 'import sys, torch
print(torch.version.cuda or "")
print(f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}")
print(",".join(a[3:] for a in torch.cuda.get_arch_list() if a.startswith("sm_")))')
{ read -r torch_cuda; read -r key; read -r torch_archs || true; } <<< "$facts"  # a CPU build: no architectures
gpu=${SAIL_HOROVOD_GPU:-}
if [ -z "$gpu" ]; then
  if [ -n "$torch_cuda" ] && command -v nvcc >/dev/null; then gpu=nccl; else gpu=none; fi
fi
case "$gpu" in
  nccl) gpu_env=(HOROVOD_GPU_OPERATIONS=NCCL) ;;
  none) gpu_env=() ;;
  *) echo "[horovod] SAIL_HOROVOD_GPU=$gpu: give nccl or none" >&2; exit 2 ;;
esac
if [ "$gpu" = nccl ] && [ -z "$torch_cuda" ]; then
  echo "[horovod] SAIL_HOROVOD_GPU=nccl needs a CUDA build of torch; this one is CPU-only" >&2
  exit 2
fi
key="$key-release-gloo-mpi"  # the build type (below), then the controllers
if [ "$gpu" = nccl ]; then
  key="$key-nccl-cuda$torch_cuda"
  # Horovod compiles its CUDA kernels for every architecture its nvcc knows (twelve with CUDA 13);
  # torch's own kernels are built for fewer (its get_arch_list(): a cubin also runs on the later minor
  # versions of its major), so Horovod's are built for the same ones, unless HOROVOD_BUILD_CUDA_CC_LIST
  # (Horovod's own setting: 80,90) names others.
  cc_list=${HOROVOD_BUILD_CUDA_CC_LIST:-$torch_archs}
  if [ -n "$cc_list" ]; then
    gpu_env+=(HOROVOD_BUILD_CUDA_CC_LIST="$cc_list")
    key="$key-sm${cc_list//,/.}"
  fi
fi
if $key_only; then echo "$key"; exit 0; fi
out="$cache/wheels/horovod-$version-$key"
if ls "$out"/horovod-*.whl >/dev/null 2>&1; then
  ls "$out"/horovod-*.whl
  exit 0
fi
if $cached_only; then exit 1; fi
echo "[horovod] building horovod $version for $key (once per machine: about 3 minutes)" >&2
if [ "$gpu" = nccl ]; then echo "[horovod] with NCCL for GPU tensors (CUDA $torch_cuda)" >&2; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download --quiet --no-deps --no-binary :all: "horovod==$version" -d "$work" >&2
tar -xzf "$work/horovod-$version.tar.gz" -C "$work"
src="$work/horovod-$version"
sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 20/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
grep -q 'CMAKE_CXX_STANDARD 20' "$src/horovod/torch/CMakeLists.txt" || {
  echo "[horovod] the C++ standard patch did not apply; the sdist layout changed" >&2
  exit 1
}
# Horovod's setup.py builds RelWithDebInfo, which its CMakeLists makes -O3 -g -DNDEBUG; Release is
# -O3 -DNDEBUG: the same code without the debug information, which took a fifth of the build's CPU
# time and 21 of the wheel's 23 MB.
sed -i "s/else 'RelWithDebInfo'/else 'Release'/" "$src/setup.py"
grep -q "else 'Release'" "$src/setup.py" || {
  echo "[horovod] the build type patch did not apply; the sdist layout changed" >&2
  exit 1
}
cuda_env=()
if [ -n "$torch_cuda" ]; then
  toolkit=${CUDA_HOME:-/usr/local/cuda}
  if ! ls "$toolkit"/lib*/libcudart.so >/dev/null 2>&1; then
    echo "[horovod] torch is a CUDA $torch_cuda build, so Horovod's torch extension links the CUDA runtime," >&2
    echo "[horovod] but $toolkit has no lib/libcudart.so: install the CUDA toolkit and set CUDA_HOME to it" >&2
    exit 1
  fi
  cuda_env=(CUDA_HOME="$toolkit" CUDAToolkit_ROOT="$toolkit")
fi
if [ "$gpu" = nccl ] && [ -z "${HOROVOD_NCCL_HOME:-}" ]; then
  # torch's wheel carries NCCL as nvidia/nccl/{include/nccl.h,lib/libnccl.so.2}; Horovod's CMake wants
  # an unversioned libnccl.so next to it.
  wheel_nccl=$("$python" -c 'import os, nvidia.nccl as n; print(os.path.dirname(n.__file__) if n.__file__ else list(n.__path__)[0])' 2>/dev/null || true)
  if [ -z "$wheel_nccl" ] || [ ! -f "$wheel_nccl/include/nccl.h" ]; then
    echo "[horovod] SAIL_HOROVOD_GPU=nccl: no NCCL found; set HOROVOD_NCCL_HOME to an NCCL install (include/, lib/)" >&2
    exit 1
  fi
  mkdir -p "$work/nccl/lib"
  ln -s "$wheel_nccl/include" "$work/nccl/include"
  ln -s "$wheel_nccl/lib/libnccl.so.2" "$work/nccl/lib/libnccl.so.2"
  ln -s "$wheel_nccl/lib/libnccl.so.2" "$work/nccl/lib/libnccl.so"
  gpu_env+=(HOROVOD_NCCL_HOME="$work/nccl" HOROVOD_NCCL_LINK=SHARED)
fi
mkdir -p "$work/wheel"
env ${cuda_env[@]+"${cuda_env[@]}"} ${gpu_env[@]+"${gpu_env[@]}"} CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
  HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j"$(nproc)" \
  "$python" -m pip wheel --quiet --no-deps --no-build-isolation "$src" -w "$work/wheel" >&2
mkdir -p "$out.tmp"
mv "$work"/wheel/horovod-*.whl "$out.tmp/"
mv "$out.tmp" "$out"
ls "$out"/horovod-*.whl
