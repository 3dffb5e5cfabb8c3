#!/usr/bin/env bash
# The one prepared device check (issue "Memory truth", item 5): on a machine with a CUDA GPU, in well under
# 10 minutes, it
#   1. takes a quick calibration of that GPU (`autopar calibrate --quick`: matmul and memory-bound rates; with
#      one GPU no collectives) and writes it as OUTDIR/<accelerator>.json, the profile to commit under
#      profiles/calibration/;
#   2. plans three 1-GPU plans of one model (recomputation none / selective / full) priced with that profile
#      and runs each for a few steps (`autopar validate --gpus-per-node 1`): measured step time and
#      torch.cuda.max_memory_allocated beside the predictions (the tensors the plan predicts: its memory less
#      the allocator reserve, which max_memory_allocated does not count);
#   3. writes OUTDIR/gpu_check.json (validate's rows) and OUTDIR/gpu_check.log (its table).
#
#   bash benchmarks/gpu_check.sh [OUTDIR]          (default: $OUT, else benchmarks/out)
#
# Nothing else depends on it. Packages: the project's own (torch, numpy, pandas, networkx, ortools); where a
# package cannot be installed on that machine, put its wheels in .whl/ and they are installed from there.
# GPU_CHECK_MODEL / GPU_CHECK_BATCH / GPU_CHECK_STEPS override the model spec, the global batch and the
# measured steps; GPU_CHECK_ALLOW_CPU=1 runs the same steps on a CPU (tests/test_gpu_check.py does, with a tiny
# model, so the script cannot rot where no GPU is).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-benchmarks/out}}
mkdir -p "$out"
py=${PYTHON:-python3}
model=${GPU_CHECK_MODEL:-llama:layers=16,hidden=2048,ffn=5632,heads=16,kv_heads=8,vocab=32000,seq=2048}
batch=${GPU_CHECK_BATCH:-8}
steps=${GPU_CHECK_STEPS:-5}

if [ -d .whl ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! "$py" -c 'import torch, numpy, pandas, networkx, ortools' 2>"$out/imports.err"; then
  echo "gpu_check: a package is missing ($(tail -n 1 "$out/imports.err")): install the project" \
       "('pip install -e .') or put its wheels in .whl/" >&2
  exit 2
fi
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  if [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then
    echo "gpu_check: torch sees no CUDA device here; run it on a GPU machine (GPU_CHECK_ALLOW_CPU=1 runs it on" \
         "the CPU, as its test does)" >&2
    exit 2
  fi
fi
name=$("$py" -c 'from runtime.measure.device import detect_device; print(detect_device().accelerator)')
profile="$out/$name.json"
echo "gpu_check: $name; calibration -> $profile" >&2
"$py" -m cli.main calibrate --quick --ranks 2 --no-progress --out "$profile"
"$py" -m cli.main validate --gpus-per-node 1 --model "$model" --global-batch "$batch" --steps "$steps" \
  --profile "$profile" --fix recompute=none --fix recompute=selective --fix recompute=full --json \
  > "$out/gpu_check.json" 2> "$out/gpu_check.log" || rc=$?
cat "$out/gpu_check.log" >&2
# validate exits 1 when a step time is outside its tolerance: a finding, reported in the table, not a failure
rc=${rc:-0}
if [ "$rc" -gt 1 ]; then exit "$rc"; fi
echo "gpu_check: wrote $out/gpu_check.json, $out/gpu_check.log and $profile" >&2
