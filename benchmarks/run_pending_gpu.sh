#!/usr/bin/env bash
# The pending GPU runs of benchmarks/RESULTS.md ("Pending GPU runs"), one device call each, every
# step's log and results under $OUT. On the device machine, from the repository root:
#
#   bash benchmarks/run_pending_gpu.sh serve     # issue 15: both sides, every fix; ~8 min
#                                                # (carry .gpu_carry/serve_whl)
#   bash benchmarks/run_pending_gpu.sh kernels   # issues 14 and 20: TMA and W4A16 paths; ~9 min
#   bash benchmarks/run_pending_gpu.sh tune      # issue 14: tune triton vs humming; ~5 min
#                                                # (carry .whl: the humming wheel)
#   bash benchmarks/run_pending_gpu.sh conformance  # triton and humming, CUDA-graph replays too,
#                                                # then the tune; ~6 min (carry .whl)
#   bash benchmarks/run_pending_gpu.sh w4a16     # issue 20: the W4A16 path through the backend,
#                                                # forced; ~8 min
#   bash benchmarks/run_pending_gpu.sh overlap   # issue 15: host/device overlap
#                                                # (MOE_RUNTIME_ASYNC_BATCHING=1); ~9 min
#                                                # (carry .gpu_carry/serve_whl)
#   bash benchmarks/run_pending_gpu.sh gqa       # issue 15: grouped-query attention for decode
#                                                # steps (MOE_RUNTIME_GQA_ATTENTION) and norms in
#                                                # one kernel (MOE_RUNTIME_FUSED_NORMS, _ROPE);
#                                                # ~10 min
#                                                # (carry .gpu_carry/serve_whl)
#   bash benchmarks/run_pending_gpu.sh defaults  # issue 15: the three kernels on by default on
#                                                # CUDA: their GPU tests, then moe-runtime's
#                                                # defaults, in-process and HTTP (openai
#                                                # client), 2 repetitions, the 16-client step
#                                                # profiles; ~8 min (carry .gpu_carry/serve_whl)
#   bash benchmarks/run_pending_gpu.sh batch16   # issue 15: captures inside the measured waves
#                                                # at an engine max batch of 16; ~5 min
#   bash benchmarks/run_pending_gpu.sh correctness  # GPU tests of the engine and the triton
#                                                # backend's conformance; ~9 min
#   bash benchmarks/run_pending_gpu.sh nvfp4_bf16  # NVFP4 with bf16 activations in bf16 MMAs:
#                                                # GPU tests and NVFP4 conformance; ~9 min
#   bash benchmarks/run_pending_gpu.sh nvfp4_bench  # their cost against fp16 MMAs; ~6 min
#   bash benchmarks/run_pending_gpu.sh defaults_theirs  # issue 15: transformers alone and
#                                                # moe-runtime's defaults one side at a time in
#                                                # one process (memory release); ~9 min
#
# Each step has a timeout of its own, so one that hangs leaves the others' results.
set -uo pipefail
OUT="${OUT:-pending-gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation --no-index -e . -e plugins/triton \
    >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 3; }

wheels() {  # install carried wheels into /tmp/site
    python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$1"/*.whl \
        >>"$OUT/install.log" 2>&1 || { echo "cannot install the wheels of $1"; exit 3; }
    export PYTHONPATH=/tmp/site
}

step() {  # step NAME SECONDS COMMAND...: run, log to $OUT/NAME.log, show its tail
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S))"
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "   exit $?"
    tail -n 25 "$OUT/$name.log"
}

case "${1:-}" in
serve)
    wheels .gpu_carry/serve_whl
    step checkpoint 90 python benchmarks/make_bench_checkpoint.py /tmp/q30 --preset qwen3-30b-a3b \
        --no-progress
    step bench_serve 300 python benchmarks/bench_serve.py --model /tmp/q30 --device cuda \
        --clients 1,4,16,64 --prompt-len 128 --max-tokens 32 --repeats 1 --profile-clients 16 \
        --no-progress --out "$OUT/serve"
    step profile_serve 120 python benchmarks/profile_serve.py --model /tmp/q30 --clients 16 \
        --graphs on --out "$OUT/prof"
    step gpu_tests 90 python -m pytest -q -p no:cacheprovider -m gpu -rs \
        tests/serve/test_engine_cuda_graphs.py
    ;;
kernels)
    # correctness first (on 2026-12-06 the tests needed more than 120 s and conformance more than
    # 90 s on an H100), then the benchmarks; the four limits add up to one 600 s call
    step kernel_tests 230 python -m pytest -q -p no:cacheprovider -rs \
        plugins/triton/tests/test_tma.py plugins/triton/tests/test_tma_wiring.py \
        plugins/triton/tests/test_w4a16.py
    # every declared combination of the backend with the TMA path forced where it can run
    step conformance_tma 170 env MOE_TRITON_TMA=1 moe-runtime conformance triton
    step bench_w4a16 80 python benchmarks/bench_w4a16.py --shapes qwen3-30b-a3b deepseek-v3 \
        --budget 60 --out "$OUT/w4a16"
    step bench_tma 110 python benchmarks/bench_tma.py --time-budget 95 --out "$OUT/tma"
    ;;
tune)
    wheels .whl
    step checkpoint 60 python benchmarks/make_bench_checkpoint.py /tmp/q30 --preset qwen3-30b-a3b \
        --layers 1 --quant nvfp4 --no-progress
    python -m pip install -q --no-deps --no-build-isolation --no-index -e plugins/humming \
        >>"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 3; }
    step tune 300 moe-runtime tune /tmp/q30 --tokens 1,16,128,1024,4096 --backends triton,humming \
        --cache "$OUT/tuning.json"
    for n in 1 128 4096; do
        step "plan_$n" 60 moe-runtime plan /tmp/q30 --tuning-cache "$OUT/tuning.json" \
            --max-tokens-per-rank "$n"
    done
    # one backend per measured batch size where another wins below the deployment's bucket
    step plan_ranges 60 moe-runtime plan /tmp/q30 --tuning-cache "$OUT/tuning.json" \
        --max-tokens-per-rank 4096 --token-ranges
    ;;
conformance)
    # every declared combination of both NVFP4-capable backends, each forward also captured in a
    # CUDA graph and its replay judged (what serve does with decode steps), then the tune again
    wheels .whl
    python -m pip install -q --no-deps --no-build-isolation --no-index -e plugins/humming \
        >>"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 3; }
    step conformance_triton 120 moe-runtime conformance triton
    step conformance_humming 200 moe-runtime conformance humming
    step checkpoint 60 python benchmarks/make_bench_checkpoint.py /tmp/q30 --preset qwen3-30b-a3b \
        --layers 1 --quant nvfp4 --no-progress
    step tune 200 moe-runtime tune /tmp/q30 --tokens 1,16,128,1024,4096 --backends triton,humming \
        --cache "$OUT/tuning.json"
    step plan_ranges 60 moe-runtime plan /tmp/q30 --tuning-cache "$OUT/tuning.json" \
        --max-tokens-per-rank 4096 --token-ranges
    ;;
w4a16)
    # the W4A16 tile path through the backend (opt-in wiring of 136cb7f, interpreter-tested
    # only): every declared combination forced onto it, CUDA-graph replays included; then the
    # NVFP4 rows of 1-128 tokens with it forced (rows against the 2026-12-04 run A of RESULTS.md)
    step w4a16_tests 150 python -m pytest -q -p no:cacheprovider -rs \
        plugins/triton/tests/test_w4a16_wiring.py plugins/triton/tests/test_w4a16.py
    step conformance_w4a16 150 env MOE_TRITON_W4A16=1 moe-runtime conformance triton
    step bench_w4a16_backend 200 env MOE_TRITON_W4A16=1 python benchmarks/bench_triton_moe.py \
        --formats nvfp4_w4a16 --tokens 1 16 128 --peers --time-budget 170 --warm-workers 15 \
        --out "$OUT/w4a16_backend"
    ;;
overlap)
    # host/device overlap (transformers' asynchronous batching, e79d7ef; CPU-tested only): the
    # GPU tests (overlapped against one step at a time: greedy tokens, seeded draws and
    # log-probabilities), then both sides overlapped at every client count, then the 16-client
    # profile (its wall ms per step against its GPU ms: what the overlap hides)
    wheels .gpu_carry/serve_whl
    step gpu_tests 150 python -m pytest -q -p no:cacheprovider -m gpu -rs \
        tests/serve/test_engine_cuda_graphs.py
    step checkpoint 60 python benchmarks/make_bench_checkpoint.py /tmp/q30 --preset qwen3-30b-a3b \
        --no-progress
    step bench_serve 280 env MOE_RUNTIME_ASYNC_BATCHING=1 python benchmarks/bench_serve.py \
        --model /tmp/q30 --device cuda --clients 1,4,16,64 --prompt-len 128 --max-tokens 32 \
        --repeats 1 --no-progress --out "$OUT/serve"
    step profile_serve 80 env MOE_RUNTIME_ASYNC_BATCHING=1 python benchmarks/profile_serve.py \
        --model /tmp/q30 --clients 16 --graphs on --out "$OUT/prof"
    ;;
gqa)
    # moe_runtime/serve/paged_attention.py (its products on tensor cores since 2026-12-07),
    # fused_norm.py and fused_rope.py: the norm kernel's and the bf16 attention's GPU tests, then each configuration in a process of its own (on 2026-12-07 the H100 ran out
    # of its 80 GB loading the second side of --one-side-at-a-time: the first side's 47 GiB were
    # still held), in-process at 1/16/64 clients: moe-runtime with all three, transformers alone,
    # moe-runtime with the norms and rotary kernels only, moe-runtime with none
    wheels .gpu_carry/serve_whl
    step gpu_tests 50 python -m pytest -q -p no:cacheprovider -m gpu -rs \
        tests/serve/test_fused_norm.py tests/serve/test_paged_attention.py
    step checkpoint 60 python benchmarks/make_bench_checkpoint.py /tmp/q30 --preset qwen3-30b-a3b \
        --no-progress
    common=(--modes in-process --model /tmp/q30 --device cuda --clients 1,16,64 --prompt-len 128
            --max-tokens 32 --repeats 1 --no-progress)
    step ours_all 100 python benchmarks/bench_serve.py --sides moe-runtime --gqa-attention \
        --fused-norms --fused-rope "${common[@]}" --out "$OUT/ours_all"
    step theirs 190 python benchmarks/bench_serve.py --sides transformers "${common[@]}" \
        --out "$OUT/theirs"
    step ours_norms_rope 80 python benchmarks/bench_serve.py --sides moe-runtime --fused-norms \
        --fused-rope "${common[@]}" --out "$OUT/ours_nr"
    step ours_off 80 python benchmarks/bench_serve.py --sides moe-runtime "${common[@]}" \
        --out "$OUT/ours_off"
    ;;
defaults)
    # grouped-query attention, one-kernel norms and rotary on by default for a model on CUDA:
    # the attention's bf16 test (padding rows of graphed steps left out of the comparison) and
    # the engine's graph tests under the defaults, then moe-runtime's side at 1/4/16/64 clients
    # (in-process and HTTP) with the eager step split at 16 clients (its forward is the sum of the
    # layers' forward times that issue 15 compares TPOT with), then the graphed step's kernels at
    # 16 clients (profile_serve: attention on tensor cores). transformers alone: `defaults_theirs`
    wheels .gpu_carry/serve_whl
    step gpu_tests 100 python -m pytest -q -p no:cacheprovider -m gpu -rs \
        tests/serve/test_paged_attention.py tests/serve/test_engine_cuda_graphs.py
    step checkpoint 60 python benchmarks/make_bench_checkpoint.py /tmp/q30 --preset qwen3-30b-a3b \
        --no-progress
    common=(--modes in-process,http --model /tmp/q30 --device cuda
            --clients "${CLIENTS:-1,4,16,64}" --prompt-len 128 --max-tokens 32
            --repeats "${REPEATS:-2}" --no-progress)
    step ours_default 190 python benchmarks/bench_serve.py --sides moe-runtime "${common[@]}" \
        --profile-clients 16 --out "$OUT/ours"
    step profile_serve 100 python benchmarks/profile_serve.py --model /tmp/q30 --clients 16 \
        --graphs on --out "$OUT/prof"
    if [ "${SKIP_THEIRS:-1}" != 1 ]; then  # SKIP_THEIRS=0: transformers alone too (~4 min more)
        step theirs 250 python benchmarks/bench_serve.py --sides transformers "${common[@]}" \
            --out "$OUT/theirs"
    fi
    ;;
defaults_theirs)
    # the GPU tests of the failed-capture recovery (on 2026-12-07 08:20 one invalidated capture
    # failed every later GPU test of the process), then both sides in one process, one at a time
    # (--one-side-at-a-time): transformers alone next to moe-runtime's defaults, each with its
    # eager 16-client step split, and the check that freeing moe-runtime's side returns its
    # memory (on 2026-12-07 01:26 the second side ran out of the 80 GB card; e7ca6d2 fixed the
    # backend's class-level config cache that held the first side's weights)
    wheels .gpu_carry/serve_whl
    if [ "${SKIP_TESTS:-0}" != 1 ]; then  # SKIP_TESTS=1: the benchmark only
        step gpu_tests 140 python -m pytest -q -p no:cacheprovider -m gpu -rs \
            tests/serve/test_paged_attention.py tests/serve/test_engine_cuda_graphs.py
    fi
    step checkpoint 60 python benchmarks/make_bench_checkpoint.py /tmp/q30 --preset qwen3-30b-a3b \
        --no-progress
    # HTTP clients in a process of their own (bench_serve's default since 2026-12-07 09:25)
    step both 500 python benchmarks/bench_serve.py --sides moe-runtime,transformers \
        --one-side-at-a-time --modes in-process,http --model /tmp/q30 --device cuda \
        --clients "${CLIENTS:-1,4,16,64}" --prompt-len 128 --max-tokens 32 \
        --repeats "${REPEATS:-1}" --profile-clients 16 --no-progress --out "$OUT/both"
    ;;
batch16)
    # the 16-client row at an engine max batch of 16 (419.8 tok/s on an H100 on 2026-12-07,
    # against 950.2 at max batch 64): the failed-capture GPU tests of b093bc5 (the cleanup on
    # the capture's device only), then moe-runtime's side at 1 and 16 clients (max batch 16)
    # with the graphs captured inside each measured wave counted (b9e90e0), with bench_serve's
    # warm-up waves of 4 tokens and then of the measured 32
    wheels .gpu_carry/serve_whl
    step gpu_tests 120 python -m pytest -q -p no:cacheprovider -m gpu -rs \
        tests/serve/test_engine_cuda_graphs.py -k failed_capture
    step checkpoint 60 python benchmarks/make_bench_checkpoint.py /tmp/q30 --preset qwen3-30b-a3b \
        --no-progress
    common=(--sides moe-runtime --modes in-process --model /tmp/q30 --device cuda --clients 1,16
            --prompt-len 128 --max-tokens 32 --repeats 2 --no-progress)
    step warm4 130 python benchmarks/bench_serve.py "${common[@]}" --out "$OUT/warm4"
    step warm32 130 python benchmarks/bench_serve.py "${common[@]}" --warmup-tokens 32 \
        --out "$OUT/warm32"
    ;;
correctness)
    # the code of 2026-12-07 afternoon that no GPU ran: the engine's GPU tests (the probe's
    # finiteness hooks under CUDA graphs, capture counting, the failed-capture cleanup of b093bc5),
    # then every declared combination of the triton backend with the suite's new cases
    # (large_activations, 8193 tokens for unbounded blocks, cuda_graphs captures)
    step gpu_tests 200 python -m pytest -q -p no:cacheprovider -m gpu -rs \
        tests/serve/test_engine_cuda_graphs.py tests/serve/test_paged_attention.py
    step conformance_triton 330 moe-runtime conformance triton -- -q -rs
    ;;
nvfp4_bf16)
    # bfloat16 MMAs for NVFP4 weights with bf16 activations (ops.nvfp4_compute_dtype): the
    # decode's bit-exactness, the large-activation paths, the plugin's other GPU tests, then every
    # declared NVFP4 combination of the triton backend (large_activations included)
    step gpu_tests 240 python -m pytest -q -p no:cacheprovider -m gpu -rs \
        plugins/triton/tests/test_nvfp4_bf16.py plugins/triton/tests/test_w4a16.py \
        plugins/triton/tests/test_kernels.py
    step conformance_nvfp4 330 moe-runtime conformance triton -- -q -rs -k nvfp4
    ;;
nvfp4_bench)
    # what the bfloat16 MMAs cost against the float16 ones, same layer and values, graph-replayed
    step bench_nvfp4_compute 560 python benchmarks/bench_nvfp4_compute.py \
        --shapes qwen3-30b-a3b deepseek-v3 --tokens 1 16 128 1024 4096 --repeats 3 \
        --out "$OUT/nvfp4"
    ;;
*)
    echo "usage: bash benchmarks/run_pending_gpu.sh serve|kernels|tune|conformance|w4a16|overlap|gqa|defaults|defaults_theirs|batch16|correctness|nvfp4_bf16|nvfp4_bench" >&2
    exit 2
    ;;
esac
