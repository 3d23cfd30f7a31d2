#!/usr/bin/env bash
# Create (or reuse) the pinned virtual environment and install this checkout into it.
#
# The environment lives outside the clone, keyed by the hash of the requirements files, so a second
# clone or a CI run on the same machine reuses it; ./.venv points at it. Override the location
# with SPIKINGSAIL_CACHE. Prints nothing but progress; exits non-zero on failure.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${SPIKINGSAIL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spikingsail}
python=${PYTHON:-python3}
key=$( (cat "$root/requirements/dev.txt" "$root/requirements/nodeps.txt"; "$python" -c 'import sys; print(sys.version)') \
  | sha256sum | cut -c1-16)
venv="$cache/venv-$key"

if [ ! -f "$venv/.complete" ]; then
  echo "[setup] creating $venv (first run on this machine: about 2 minutes)"
  rm -rf "$venv"
  mkdir -p "$cache"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet -r "$root/requirements/dev.txt"
  "$venv/bin/python" -m pip install --quiet --no-deps -r "$root/requirements/nodeps.txt"
  touch "$venv/.complete"
fi
"$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$root"
ln -sfn "$venv" "$root/.venv"
echo "[setup] ready: source $root/.venv/bin/activate"
