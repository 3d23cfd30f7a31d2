#!/usr/bin/env bash
# Compile DeepSpeed's CPU ops into the environment VENV (nothing to do when they are built), with the
# first ninja on PATH: the one the tests use too (tests/ninja.py). Objects another ninja version built
# are compiled again, once, here rather than inside a test.
set -euo pipefail
venv=$1
TORCH_EXTENSIONS_DIR="$venv/torch_extensions" DS_ACCELERATOR=cpu "$venv/bin/python" -c '
from deepspeed.accelerator import get_accelerator
for op in ("ShareMemCommBuilder", "FusedAdamBuilder"):
    get_accelerator().create_op_builder(op).load()
' >/dev/null
