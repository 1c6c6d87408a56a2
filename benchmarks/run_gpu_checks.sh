#!/usr/bin/env bash
# GPU correctness checks, one device call: the conformance suite on every backend this machine can
# run (bf16 paths need a real GPU: Triton's interpreter cannot check them), the GPU tests of the
# core and plugins, and the model-level comparison with transformers in bf16.
# Usage on the device machine: bash benchmarks/run_gpu_checks.sh  (writes logs under $OUT)
# Tiny ModelOpt exports are read from .gpu_carry/tiny (made where nvidia-modelopt is installed:
# MOE_RUNTIME_TINY_CACHE=.gpu_carry/tiny python -m pytest tests/execution).
set -uo pipefail
OUT="${OUT:-gpu-checks-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MOE_RUNTIME_TINY_CACHE="$PWD/.gpu_carry/tiny"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
python -m pip install --quiet --no-deps --no-build-isolation --no-index \
    -e . -e plugins/triton -e plugins/flashinfer_cutedsl -e plugins/deepep 2>&1 | tail -3
moe-runtime plugins > "$OUT/plugins.txt" 2>&1
for b in reference triton local torch_all_to_all; do
    echo "== conformance $b" | tee -a "$OUT/summary.txt"
    timeout 300 moe-runtime conformance "$b" 2>&1 | tee "$OUT/conformance-$b.log" | tail -4 | tee -a "$OUT/summary.txt"
done
echo "== gpu tests" | tee -a "$OUT/summary.txt"
timeout 400 python -m pytest -q -p no:cacheprovider -m gpu -rs \
    tests/execution/test_model_layers.py tests/quant plugins/triton/tests 2>&1 \
    | tee "$OUT/gpu-tests.log" | tail -15 | tee -a "$OUT/summary.txt"
