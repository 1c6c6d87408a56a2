#!/usr/bin/env bash
# One device call: the conformance suite on the triton (and reference) backend with junit output,
# the worst error/budget ratio per format, and serve-vs-generate greedy on a tiny DeepSeek-V3.
# Usage on the device machine: bash benchmarks/run_conformance_gpu.sh [BACKEND ...]  (writes under $OUT)
# Extra backends (humming, reference, ...) run the suite after triton; MOE_GPU_ROUTING=1 adds
# benchmarks/bench_routing.py.
# Carried: .whl (server and openai wheels for the image's Python), .gpu_carry/dsv3 (tiny export).
set -uo pipefail
OUT="${OUT:-gpu-conformance-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install --quiet --no-deps --no-build-isolation --no-index \
    -e . -e plugins/triton -e plugins/flashinfer_cutedsl -e plugins/deepep -e plugins/humming 2>&1 | tail -3
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
for b in triton "${@}"; do
    echo "== conformance $b" | tee -a "$OUT/summary.txt"
    timeout 420 python3 -m moe_runtime.cli conformance "$b" -- -q -o junit_family=xunit1 "--junitxml=$OUT/$b.xml" \
        > "$OUT/conformance-$b.log" 2>&1
    tail -4 "$OUT/conformance-$b.log" | tee -a "$OUT/summary.txt"
    python3 - "$OUT/$b.xml" <<'PY' | tee -a "$OUT/summary.txt"
import collections, sys, xml.etree.ElementTree as ET
worst, count, failed = collections.defaultdict(float), collections.Counter(), collections.Counter()
for tc in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    props = {p.get("name"): p.get("value") for p in tc.iter("property")}
    if "error_budget_ratio" in props:
        f = props["format"]
        count[f] += 1
        worst[f] = max(worst[f], float(props["error_budget_ratio"]))
        failed[f] += tc.find("failure") is not None
for f in sorted(count):
    print(f"{f}: {count[f]} cases run, {failed[f]} failed, worst error/budget {worst[f]:.3f}")
for tc in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    bad = tc.find("failure")
    if bad is None:
        bad = tc.find("error")
    if bad is not None:
        print("FAILED", tc.get("name"), "::", (bad.get("message") or "")[:600].replace("\n", " | "))
PY
done
echo "== plugin tests on the GPU (plugins/triton/tests)" | tee -a "$OUT/summary.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider plugins/triton/tests -o junit_family=xunit1 \
    "--junitxml=$OUT/triton-tests.xml" > "$OUT/triton-tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/triton-tests.log" | tail -15 | tee -a "$OUT/summary.txt"
if [ -d .gpu_carry/dsv3 ]; then
    echo "== serve greedy vs generate, tiny DeepSeek-V3 (cuda)" | tee -a "$OUT/summary.txt"
    timeout 300 python3 benchmarks/check_serve_greedy.py "$OUT/greedy-dsv3.json" \
        --model .gpu_carry/dsv3 --device cuda > "$OUT/greedy.log" 2>&1
    echo "exit $?" | tee -a "$OUT/summary.txt"
    tail -5 "$OUT/greedy.log" | tee -a "$OUT/summary.txt"
fi
if [ "${MOE_GPU_ROUTING:-0}" = 1 ]; then
    echo "== routing benchmark" | tee -a "$OUT/summary.txt"
    timeout 200 python3 benchmarks/bench_routing.py --out "$OUT" > "$OUT/routing.log" 2>&1
    echo "exit $?" | tee -a "$OUT/summary.txt"
    tail -30 "$OUT/routing.log" | tee -a "$OUT/summary.txt"
fi
