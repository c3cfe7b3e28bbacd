#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: CUDA paths of the test suite, the benchmark
# on cuda vs cpu, the memory bandwidth each codec reaches against the GPU's measured triad and
# its peak, and the paper grid (S=1024, Nq=64) timed on the GPU. Writes to ${OUT:-gpu-out}.
# Usage: bash scripts/gpu_check.sh      (PYTHON: a Python with kvharness's dependencies and a CUDA
# build of torch; default .venv/bin/python). Without a visible GPU it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}; mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
if ! "$py" -c "import torch" 2>/dev/null; then
    echo "gpu_check: $py cannot import torch; set PYTHON to a Python with kvharness's dependencies" >&2
    exit 1
fi
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no GPU figures: torch.cuda.is_available() is False here (torch $("$py" -c 'import torch; print(torch.__version__)')); run this on a machine with an NVIDIA GPU and a CUDA build of torch" | tee "$out/device.txt"
    exit 0
fi
"$py" -c "import torch; print(torch.cuda.get_device_name())" | tee "$out/device.txt"
"$py" -m harness bench --device cuda --json > "$out/bench-cuda.json" || exit 1
# the bandwidth figures of the CUDA bench: the triad on the GPU against the GPU's peak (2 x memory
# clock x bus width, from torch's device properties or NVML), and each codec's least traffic per
# vector with the fraction of the triad and of the peak it reaches
"$py" -c "import json, sys; from harness.bandwidth import bandwidth_lines
print('\n'.join(bandwidth_lines(json.load(open(sys.argv[1])))))" "$out/bench-cuda.json" | tee "$out/bandwidth.txt"
"$py" -m harness bench --device cpu --json > "$out/bench-cpu.json"
# statistically equivalent results on CPU and GPU for one cell (validate --vary device)
"$py" -m harness validate --scenario gaussian --scheme tq-kv --vary device --json > "$out/validate-device.json" || true
start=$(date +%s)
"$py" -m harness run --grid paper --device cuda --out "$out/paper-grid" --quiet --resume
echo "paper grid wall seconds: $(( $(date +%s) - start ))" | tee "$out/paper-grid-time.txt"
