#!/usr/bin/env bash
# Create (or reuse) the pinned virtual environment and install this checkout into it.
#
#   scripts/setup.sh              the developer environment: torch, spikingjelly and the tools (uv)
#   scripts/setup.sh --main       only what the main job needs (requirements/main.txt), installed
#                                 with uv: scripts/main.sh; a complete developer environment is
#                                 used instead when there is one (no second install)
#   scripts/setup.sh --backends   also DeepSpeed and Horovod, with their compiled parts (the tests)
#   scripts/setup.sh --horovod    only Horovod, into an environment --backends set up with
#                                 SAIL_HOROVOD_LATER=1 (which leaves an unbuilt Horovod for later:
#                                 scripts/test.sh builds it beside its first tests)
#
# The environment lives outside the clone, keyed by the hash of the requirements files, so a second
# clone or a CI run on the same machine reuses it; ./.venv points at it. Override the location
# with SPIKINGSAIL_CACHE. Prints nothing but progress; exits non-zero on failure.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${SPIKINGSAIL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spikingsail}
# The interpreter: $PYTHON; else the distribution's /usr/bin/python3 where it is the same Python X.Y
# as python3 on PATH and has its headers (Horovod and DeepSpeed's ops compile against them) and pip
# (which installs uv: Debian ships pip, venv and the headers in packages of their own); else
# python3 on PATH. Distributions build CPython with profile-guided and link-time optimisation, and a
# CPython built from source with the defaults (pyenv's, asdf's) has neither, so everything runs
# slower on it: on a 2-core CI machine `import torch` took 2.7-2.8 CPU-s against 3.2-4.0
# (docs/benchmarks.md#the-test-suite has what it does to the tests).
python=${PYTHON:-python3}
distribution_python=${SAIL_DISTRIBUTION_PYTHON:-/usr/bin/python3}  # another path only in tests/tooling
if [ -z "${PYTHON:-}" ] && [ -x "$distribution_python" ] && [ "$(command -v python3 || true)" != "$distribution_python" ] &&
  "$distribution_python" - "$(python3 -c 'import sys; print(sys.version_info[:2])' 2>/dev/null || true)" 2>/dev/null <<'EOF'
import importlib.util, os, sys, sysconfig
headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
found = str(sys.version_info[:2]) == sys.argv[1] and os.path.exists(headers) and importlib.util.find_spec("pip")
sys.exit(0 if found else 1)
EOF
then
  python=$distribution_python
fi
python_version=$("$python" -c 'import sys; print(sys.version)')
key=$( (cat "$root"/requirements/{main,dev,nodeps,sdist,backends}.txt "$root/scripts/build-horovod.sh"
        echo "$python_version") | sha256sum | cut -c1-16)
venv="$cache/venv-$key"
uv_pin=uv==0.13.9  # the lean environment's installer: it downloads and unpacks in parallel
uv_home="$cache/uv-${uv_pin#uv==}"

uv_sources() {  # uv reads no pip configuration: pip's indexes, find-links and constraints as uv flags
  "$1" - <<'EOF'
import ast, os, subprocess, sys
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
         "find-links": "--find-links", "constraint": "--constraint"}
found = {}
config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
for line in config.stdout.splitlines():
    name, _, value = line.partition("=")
    flag = flags.get(name.rpartition(".")[2])
    for item in ast.literal_eval(value).split() if flag and value else ():
        local = item.removeprefix("file://")
        if "://" in local or os.path.exists(local):  # a configured local store this machine lacks: skipped
            found.setdefault(flag, {}).setdefault(item, None)
if "--index-url" in found:
    found["--index-url"] = dict.fromkeys(list(found["--index-url"])[-1:])  # the last scope's, as in pip
for flag, items in found.items():
    for item in items:
        print(flag, item, sep="\n")
if "--extra-index-url" in found:  # pip takes the best version from all indexes; uv's default, the first's
    print("--index-strategy", "unsafe-best-match", sep="\n")
EOF
}

install_uv() {  # the pinned uv into $uv_home, once per machine: by the system python's pip, else a venv's
  rm -rf "$uv_home"
  if "$python" -m pip --version >/dev/null 2>&1 &&
    PIP_ROOT_USER_ACTION=ignore "$python" -m pip install -qq --target "$uv_home" "$uv_pin"; then  # -qq: errors only
    return
  fi
  rm -rf "$uv_home"
  "$python" -m venv "$uv_home" && "$uv_home/bin/python" -m pip install --quiet "$uv_pin"
}

uv_ready() {  # the pinned uv is here (installed once per machine); $uv_flags: pip's sources for it
  [ -x "$uv_home/bin/uv" ] || install_uv || return 1
  local pip_python=$python line
  "$python" -m pip --version >/dev/null 2>&1 || pip_python=$uv_home/bin/python  # where uv_sources asks pip
  uv_flags=()
  while IFS= read -r line; do uv_flags+=("$line"); done < <(uv_sources "$pip_python")
}

uv_pip() {  # uv pip install ARGS... into $venv, from pip's sources
  "$uv_home/bin/uv" pip install --quiet --python "$venv/bin/python" ${uv_flags[@]+"${uv_flags[@]}"} "$@"
}

lean_environment() {  # requirements/main.txt alone into $venv, with uv (with pip where uv does not install)
  echo "[setup] creating $venv with only what the main job needs (first run on this machine: about a minute)"
  rm -rf "$venv"
  mkdir -p "$cache"
  "$python" -m venv --without-pip "$venv"  # uv installs pip with the rest, not ensurepip, which is slower
  if uv_ready && uv_pip -r "$root/requirements/main.txt" pip; then
    return
  fi
  echo "[setup] uv did not install (above); installing with pip instead"
  "$venv/bin/python" -m ensurepip --upgrade >/dev/null
  "$venv/bin/python" -m pip install --quiet -r "$root/requirements/main.txt"
}

developer_environment() {  # dev.txt and nodeps.txt with uv (pip where uv does not), then the sdists with pip
  echo "[setup] creating $venv (first run on this machine: about 2 minutes)"
  rm -rf "$venv"
  mkdir -p "$cache"
  "$python" -m venv --without-pip "$venv"
  if ! { uv_ready && uv_pip -r "$root/requirements/dev.txt" pip &&
         uv_pip --no-deps -r "$root/requirements/nodeps.txt"; }; then
    echo "[setup] uv did not install (above); installing with pip instead"
    "$venv/bin/python" -m ensurepip --upgrade >/dev/null
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet -r "$root/requirements/dev.txt"
    "$venv/bin/python" -m pip install --quiet --no-deps -r "$root/requirements/nodeps.txt"
  fi
  # norse's sdist names itself 0.0.0 (see sdist.txt): pip downloads the pinned file, then installs it.
  # --no-binary names the pinned packages only: :all: would build the build backend (setuptools) from
  # its source too, just to read the sdist's metadata (22 s against 3 s).
  local sdists names
  sdists=$(mktemp -d)
  names=$(sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' "$root/requirements/sdist.txt" | paste -sd, -)
  "$venv/bin/python" -m pip download --quiet --no-deps --no-binary "$names" -d "$sdists" -r "$root/requirements/sdist.txt"
  "$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation "$sdists"/*.tar.gz
  rm -rf "$sdists"
  touch "$venv/.complete"
}

install_horovod() {  # Horovod's wheel, built once per machine (scripts/build-horovod.sh), into $venv
  local wheel
  wheel=$(bash "$root/scripts/build-horovod.sh" "$venv/bin/python")
  "$venv/bin/python" -m pip install --quiet --no-deps "$wheel"
}

if [ "${1:-}" = "--horovod" ]; then
  if [ ! -f "$venv/.complete" ]; then
    echo "[setup] --horovod: there is no environment at $venv yet: run scripts/setup.sh --backends" >&2
    exit 1
  fi
  if [ ! -f "$venv/.backends-complete" ]; then
    install_horovod
    touch "$venv/.backends-complete"
  fi
  exit 0
fi
lean=0 fresh=0
if [ "${1:-}" = "--main" ] && [ ! -f "$venv/.complete" ]; then
  venv="$cache/venv-main-$( (cat "$root/requirements/main.txt"; echo "$python_version") | sha256sum | cut -c1-16)"
  lean=1
  if [ ! -f "$venv/.complete" ]; then
    lean_environment
    fresh=1
  fi
elif [ ! -f "$venv/.complete" ]; then
  developer_environment
fi
system_packages() {  # scripts/install.sh installs Debian's packages meanwhile: wait for them, once
  local deps=${SAIL_SYSTEM_DEPS:-}
  [ -n "$deps" ] || return 0
  while [ ! -f "$deps/status" ]; do sleep 0.2; done
  if [ "$(cat "$deps/status")" != 0 ]; then
    echo "[setup] Debian's packages failed to install (scripts/system-deps.sh):" >&2
    cat "$deps/log" >&2
    exit 1
  fi
}

if [ "${1:-}" = "--backends" ] && [ ! -f "$venv/.backends-complete" ]; then
  system_packages
  echo "[setup] adding DeepSpeed and Horovod (first run on this machine: about a minute and a half, 4 if Horovod must be built)"
  DS_BUILD_OPS=0 "$venv/bin/python" -m pip install --quiet -r "$root/requirements/backends.txt"
  later=0
  if [ "${SAIL_HOROVOD_LATER:-0}" = 1 ] && ! bash "$root/scripts/build-horovod.sh" --cached "$venv/bin/python" >/dev/null; then
    echo "[setup] Horovod is not built on this machine yet: scripts/setup.sh --horovod builds and installs it"
    later=1
  else
    install_horovod
  fi
  # DeepSpeed compiles its CPU ops on first use; do it once here, into the environment, so that
  # no run pays for it (the tests point TORCH_EXTENSIONS_DIR at the same place).
  bash "$root/scripts/deepspeed-ops.sh" "$venv"
  if [ "$later" = 0 ]; then touch "$venv/.backends-complete"; fi
fi
# On GPU nodes DeepSpeed compiles FusedAdam (what a config's Adam/AdamW becomes) with nvcc at the
# first step of a job, on every node; SAIL_DEEPSPEED_CUDA_OPS=1 builds its CUDA ops into the
# installed DeepSpeed once instead (needs the CUDA toolkit of torch's CUDA here; `sail doctor` says).
if [ "${1:-}" = "--backends" ] && [ "${SAIL_DEEPSPEED_CUDA_OPS:-0}" = 1 ] && [ ! -f "$venv/.deepspeed-cuda-ops" ]; then
  if ! PYTHONPATH="$root/src" "$venv/bin/python" -c '
import os, sys, torch
from torch.utils.cpp_extension import CUDA_HOME
if not torch.version.cuda or CUDA_HOME is None:
    sys.exit(f"[setup] SAIL_DEEPSPEED_CUDA_OPS=1: cannot build DeepSpeed'"'"'s CUDA ops here: "
             + ("this torch is a CPU build" if not torch.version.cuda else
                f"no CUDA toolkit (nvcc) found; install CUDA {torch.version.cuda} and set CUDA_HOME"))
from spikingsail.cuda_arch_list import readable_setting, unreadable_cuda_archs
archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
if unreadable_cuda_archs(archs):
    sys.exit(f"[setup] SAIL_DEEPSPEED_CUDA_OPS=1: DeepSpeed cannot build for TORCH_CUDA_ARCH_LIST={archs!r} "
             f"(it reads MAJOR.MINOR[+PTX] entries only): run it again with "
             f"{readable_setting(archs, or_unset=True)}")
'; then
    exit 1
  fi
  echo "[setup] building DeepSpeed's CUDA ops (FusedAdam, CPU Adam) into the environment (several minutes of compiling)"
  ds_pin=$(grep -E '^deepspeed==' "$root/requirements/backends.txt")
  DS_BUILD_FUSED_ADAM=1 DS_BUILD_CPU_ADAM=1 "$venv/bin/python" -m pip install --quiet --no-deps \
    --no-build-isolation --no-cache-dir --force-reinstall "$ds_pin"
  touch "$venv/.deepspeed-cuda-ops"
fi
if [ "${1:-}" != "--main" ] && [ ! -f "$venv/.bytecode-complete" ]; then  # main.sh: the job's alone, below
  # uv writes no bytecode, and where PYTHONDONTWRITEBYTECODE is set no process writes any either: each
  # would compile everything it imports (torch's import: 10.7 CPU-s from source, 5.3 from bytecode).
  # Written once for everything installed; files that are not Python 3 (templates, examples) are skipped.
  echo "[setup] writing the environment's bytecode (once: about a minute)"
  "$venv/bin/python" -m compileall -q -q -j 0 \
    "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
  touch "$venv/.bytecode-complete"
fi
if [ "$lean" = 1 ] && [ -x "$uv_home/bin/uv" ]; then  # uv installs this checkout in a second, pip in five
  "$uv_home/bin/uv" pip install --quiet --python "$venv/bin/python" --no-deps --no-build-isolation -e "$root"
else
  "$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$root"
fi
if [ "$fresh" = 1 ]; then
  # uv writes no bytecode (pip compiles every file: much of its time). Write it once for what the
  # main job's processes import, or each of them compiles torch's modules again on every run where
  # PYTHONDONTWRITEBYTECODE is set.
  env -u PYTHONDONTWRITEBYTECODE "$venv/bin/python" -c 'import torch.distributed.run
import spikingsail.backends.ddp, spikingsail.cli.main, spikingsail.data.digits, spikingsail.engine.engine'
  touch "$venv/.complete"
fi
ln -sfn "$venv" "$root/.venv"
echo "[setup] ready: source $root/.venv/bin/activate"
