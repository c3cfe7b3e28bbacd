#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: CUDA paths of the test suite, the benchmark
# on cuda vs cpu, and the paper grid (S=1024, Nq=64) timed on the GPU. Writes to ${OUT:-gpu-out}.
# Usage: bash scripts/gpu_check.sh      (expects .venv with a CUDA build of torch, or installs one)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}; mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'; print(torch.cuda.get_device_name())" | tee "$out/device.txt" || exit 1
"$py" -m harness bench --device cuda --json > "$out/bench-cuda.json"
"$py" -m harness bench --device cpu --json > "$out/bench-cpu.json"
# statistically equivalent results on CPU and GPU for one cell (validate --vary device)
"$py" -m harness validate --scenario gaussian --scheme tq-kv --vary device --json > "$out/validate-device.json" || true
start=$(date +%s)
"$py" -m harness run --grid paper --device cuda --out "$out/paper-grid" --quiet --resume
echo "paper grid wall seconds: $(( $(date +%s) - start ))" | tee "$out/paper-grid-time.txt"
