#!/usr/bin/env bash
# The GPU checks, in a few minutes, on a machine with one or more NVIDIA GPUs: the main job on nccl,
# the main job under every backend, replica groups, resume, the requires_cuda tests, the
# communication bench and the engine-versus-plain-loop benchmark (benchmarks/gpu.py: run first, the
# longest check; its table last). Prints a pass/fail table; the exit status is the number of failed
# rows. Logs: $SMOKE_DIR. A check that runs past $SMOKE_CHECK_SECONDS (default 600) fails.
#
#   bash scripts/gpu-smoke.sh                  (after scripts/setup.sh --backends)
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
python=${PYTHON:-$root/.venv/bin/python}
sail=(env DS_ACCELERATOR=cuda "$python" -m spikingsail.cli.main)
logs=${SMOKE_DIR:-$(mktemp -d -t sail-gpu-smoke-XXXX)}
limit=${SMOKE_CHECK_SECONDS:-600}
mkdir -p "$logs"

gpus=$("$python" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "$gpus" -lt 1 ]; then
  echo "gpu-smoke: torch sees no CUDA GPU here (torch.cuda.is_available() is False); nothing to check" >&2
  exit 1
fi
nproc=$(( gpus < 2 ? gpus : 2 ))
echo "gpu-smoke: $gpus GPU(s) ($("$python" -c 'import torch; print(torch.cuda.get_device_name(0))')), $nproc process(es) per job, logs in $logs"

rows=()
failed=0
row() {  # row NAME SECONDS STATUS
  rows+=("$(printf '%-44s %-5s %6ss' "$1" "$3" "$2")")
  if [ "$3" = FAIL ]; then failed=$((failed + 1)); fi  # SKIP: what this machine cannot check
}
check() {  # check NAME EXPECTED-OUTPUT-REGEX COMMAND...: passes when it exits 0 and prints the match
  local name=$1 expect=$2 log="$logs/$(echo "$1" | tr -c 'a-zA-Z0-9' _).log" start
  shift 2
  start=$(date +%s)
  if timeout "$limit" "$@" >"$log" 2>&1 && grep -Eq "$expect" "$log"; then status=PASS; else status=FAIL; fi
  row "$name" "$(( $(date +%s) - start ))" "$status"
  [ "$status" = PASS ] || echo "  $name failed: see $log" >&2
}
config() {  # config BACKEND EXTRA-JSON: the main job's config for one backend, on stdout as a path
  local path="$logs/$1$(echo "$2" | tr -c 'a-z0-9' _).json"
  "$python" - "$1" "$2" "$path" <<'EOF'
import json, sys
backend, extra, path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
config = json.load(open("examples/configs/digits.json"))
config["sail"]["backend"] = backend
config["sail"].pop("metrics_path", None)
config.update(extra)
json.dump(config, open(path, "w"))
EOF
  echo "$path"
}

# the engine against the plain loop on one GPU (minutes): its table follows this one
bench="benchmarks/gpu.py (engine ÷ plain loop)"
check "$bench" 'engine÷plain' env DS_ACCELERATOR=cuda "$python" benchmarks/gpu.py

accuracy='test accuracy: 0\.9[5-9]|test accuracy: 1\.0'
check "main job, ddp on nccl" "$accuracy" "${sail[@]}" launch -n "$nproc" examples/train_digits.py
check "main job, ddp + ZeRO-1" "$accuracy" \
  "${sail[@]}" launch -n "$nproc" examples/train_digits.py --sail-config "$(config ddp '{"zero_optimization": {"stage": 1}}')"
check "main job, fsdp" "$accuracy" \
  "${sail[@]}" launch -n "$nproc" examples/train_digits.py --sail-config "$(config fsdp '{}')"
zero2=$(config deepspeed "$("$python" -c 'import torch; print("{\"zero_optimization\": {\"stage\": 2}, \"" + ("bf16" if torch.cuda.get_device_capability(0)[0] >= 8 else "fp16") + "\": {\"enabled\": true}}")')")
# DeepSpeed reads TORCH_CUDA_ARCH_LIST entries as MAJOR.MINOR[+PTX] only; where the environment has
# one of torch's other forms ("9.0a", as some CUDA images set), the job must refuse, saying so, and
# train with the readable form.
ds_env=(env)
if readable=$("$python" -c '
import os, sys
from spikingsail.cuda_arch_list import readable_cuda_archs, unreadable_cuda_archs
archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
print(readable_cuda_archs(archs))
sys.exit(0 if unreadable_cuda_archs(archs) else 1)'); then
  check "deepspeed refuses TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST" "cannot build its fused_adam op for TORCH_CUDA_ARCH_LIST" \
    bash -c "! ${sail[*]} launch -n $nproc examples/train_digits.py --sail-config $zero2"
  if [ -n "$readable" ]; then ds_env=(env "TORCH_CUDA_ARCH_LIST=$readable"); else ds_env=(env -u TORCH_CUDA_ARCH_LIST); fi
fi
check "main job, deepspeed ZeRO-2 (bf16 or fp16)" "$accuracy" \
  "${ds_env[@]}" "${sail[@]}" launch -n "$nproc" examples/train_digits.py --sail-config "$zero2"
if "$python" -c 'import horovod.torch' 2>/dev/null; then
  check "main job, horovod" "$accuracy" \
    "${sail[@]}" launch -n "$nproc" examples/train_digits.py --sail-config "$(config horovod '{}')"
else
  row "main job, horovod (not installed)" 0 SKIP
fi
check "spiking main job (snn_digits)" 'test accuracy' "${sail[@]}" launch -n "$nproc" examples/snn_digits.py
if [ "$gpus" -ge 2 ]; then  # each group on a GPU of its own; torchft's NCCL all-reduce across them
  check "replica groups (--ft-replicas 2, NCCL)" "$accuracy" \
    "${sail[@]}" launch --ft-replicas 2 -n 1 examples/train_digits.py
else
  row "replica groups (needs 2 GPUs)" 0 SKIP
fi
checkpoints="$logs/checkpoints"
saving=$(config ddp '{"checkpoint": {"interval_steps": 20}}')
check "save every 20 steps, then --resume" "$accuracy" bash -c "
  ${sail[*]} launch -n $nproc examples/train_digits.py --epochs 3 --sail-config $saving --checkpoints-path $checkpoints &&
  ls $checkpoints/latest &&
  ${sail[*]} launch -n $nproc examples/train_digits.py --sail-config $saving --resume --checkpoints-path $checkpoints"
check "requires_cuda tests" ' passed' env DS_ACCELERATOR=cuda "$python" -m pytest -q -m requires_cuda tests/gpu
check "sail bench comm (nccl)" 'all-reduce|all_reduce' "${sail[@]}" bench comm -n "$nproc"

echo
printf '%-44s %-5s %7s\n' check result time
for r in "${rows[@]}"; do echo "$r"; done
echo "failed: $failed (logs in $logs)"
bench_log="$logs/$(echo "$bench" | tr -c 'a-zA-Z0-9' _).log"  # as check names it
if [ -f "$bench_log" ]; then echo; sed -n '/^row /,$p' "$bench_log"; fi
exit "$failed"
