#!/usr/bin/env bash
# Every GPU-side check and benchmark in one device call; results land in $OUT.
#   bash benchmarks/gpu_suite.sh [part ...]   (on the GPU machine, from the repository root)
# Then copy $OUT/*.json into benchmarks/results/ and commit them.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/kiln-gpu}
mkdir -p "$OUT"
log="$OUT/gpu_suite.log"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee -a "$log"
status=0
run() {
    echo "=== $*" | tee -a "$log"
    local start=$SECONDS
    "$@" 2>&1 | tee -a "$log" | grep --line-buffered -vE "INFO|it/s\]|piece/s"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    echo "=== took $((SECONDS - start)) s" | tee -a "$log"
}
# Parts, in the order they run; name some to run only those (a device call lasts at most
# 10 minutes, and all of them together take longer: split them over two calls, e.g.
# `bash benchmarks/gpu_suite.sh kernels graphs tiles` then `... engine cache bench`).
# gemm, attention, attention-sweep, partition, prefix, prefix-steps, families, cache-nopyc, fresh, fresh-aot, first-use, profile, aot-probe, ladder, decode, pdl, gc, reference, throughput, serving and tp (not in the default list):
# Inductor's partitions under CUDA graphs, prefix caching's TTFT, the model families, the cache part without cached bytecode, a fresh
# machine's start, kiln's decode beside the stock loop, that loop alone, offline throughput, online serving, and
# the tensor-parallel comparison (2 GPUs).
parts=${*:-kernels gemv graphs tiles engine dynamo cache bench}
for part in $parts; do
    case $part in
        kernels) run python benchmarks/gpu_kernels.py "$OUT" ;;
        gemv) run python benchmarks/gemv.py --out "$OUT" ;;
        # cuBLAS, cuBLASLt and Inductor's Triton templates at decode sizes 64-256 (about 2 minutes).
        gemm) run python benchmarks/gemm_choices.py --out "$OUT" ;;
        graphs) run python benchmarks/cudagraphs.py --out "$OUT" --profile --recapture default ;;
        tiles) run python benchmarks/attention_tiles.py --out "$OUT" ;;
        # Inductor's partitions under piecewise CUDA graphs beside the FX split, and SGLang's static
        # decode compile: tokens against eager (input addresses checked on every replay), decode
        # step at 1/64/256, capture time, graph memory.
        partition) run python benchmarks/cudagraphs.py --out "$OUT" --tag partition --check-debug --batches 1 64 256 \
                       --check-modes eager "O2 FULL_AND_PIECEWISE" "O2 PIECEWISE" "O2 partition PIECEWISE" \
                           "O2 partition FULL_AND_PIECEWISE" "static compile decode" \
                       --bench-modes "O2 FULL_AND_PIECEWISE" "O2 PIECEWISE" "O2 partition PIECEWISE" \
                           "O2 partition FULL_AND_PIECEWISE" "static compile decode" ;;
        # Decode attention at batches 64 and 256 (tiles, warps, stages, splits, early values).
        tiles-large) run python benchmarks/attention_tiles.py --large-batches --out "$OUT" ;;
        # Decode attention at batches 64-256, contexts 128-4096, each layer reading its own cache, against
        # the byte floor, and a 2048-token prefill against the matmul rate (attention-sweep: every tile too).
        attention) run python benchmarks/decode_attention.py --quick --out "$OUT" ;;
        attention-sweep) run python benchmarks/decode_attention.py --out "$OUT" ;;
        engine) run python benchmarks/engine_throughput.py --device cuda --model llama-3-8b --out "$OUT" ;;
        # Dynamo alone (a CPU trace) under this machine's torch: can it stamp layers?
        dynamo) run python benchmarks/dynamo_trace.py --runs 3 --out "$OUT" ;;
        # Bytecode cached under a prefix (as on an install pip compiled); cache-nopyc: this
        # machine's install as it is (no usable .pyc: every import compiles source).
        cache) run python benchmarks/cache_start.py --device cuda --model llama-3-8b --out "$OUT" \
                   --pycache-prefix "${KILN_PYCACHE:-/tmp/kiln-pycache}" ;;
        cache-nopyc) run python benchmarks/cache_start.py --device cuda --model llama-3-8b --out "$OUT" ;;
        # A fresh machine: cold, imported archive and warm starts, default and -O2, beside stock
        # torch.compile's first call (about 5 minutes).
        fresh) run python benchmarks/fresh_start.py --modes default O2 --out "$OUT" ;;
        # -O2 imported and warm from AOTInductor packages (prewarm --aot) beside plain -O2's, one run
        # (refused on CUDA for now: docs/compile-cache.md).
        fresh-aot) mkdir -p "$OUT/aot" && run python benchmarks/fresh_start.py --modes O2-aot O2 --no-reference \
                       --warm-only --out "$OUT/aot" ;;
        # Mixed-batch graphs left for first use: every graph mode's tokens against eager's with them
        # (generated twice, around the idle captures), then -O2 starts with and without, in both
        # orders (about 5 minutes).
        first-use) run python benchmarks/cudagraphs.py --check-debug --skip-bench --tag first-use --out "$OUT" \
                       --check-modes eager "O2 FULL_AND_PIECEWISE" "O2 FULL_AND_PIECEWISE at start" "O2 FULL" default
                   for order in "O2 O2-graphs-at-start" "O2-graphs-at-start O2"; do
                       mkdir -p "$OUT/first-use-${order%% *}"
                       run python benchmarks/fresh_start.py --modes $order --no-reference --warm-only \
                           --out "$OUT/first-use-${order%% *}"
                   done ;;
        # The default mode's and -O2's decode steps under torch.profiler at b1/64/256: kernels, launches,
        # GPU idle time (about a minute).
        profile) run python benchmarks/profile_step.py --modes default "compiled -O2" --batch 1 64 256 --context 128 \
                     --top 30 --out "$OUT" ;;
        # Which AOTInductor packages torch's loader loads, runs and captures on this GPU (about a minute).
        aot-probe) run python benchmarks/aot_cuda_probe.py --out "$OUT" ;;
        # The mixed-batch phase's coarse ladder beside the fine one under -O2: warm-start capture
        # time, and one n-token prompt's generate() at each n to 128 (about 3 minutes).
        ladder) run python benchmarks/prefill_ladder.py --out "$OUT" ;;
        # kiln's engine step (async scheduling on and off) and forward beside the stock loop, same run.
        decode) run python benchmarks/decode_vs_reference.py --modes default O2 --out "$OUT" ;;
        # Programmatic dependent launch (kiln.ops.triton.dependent_launch): the default mode's decode
        # with KILN_PDL 0, 2, 1, 0 (one process each, tokens digests compared), then -O2 with
        # Inductor's kernels dependent too (about 5 minutes).
        pdl) i=0
             for mode in 0 2 1 0; do
                 i=$((i + 1))
                 KILN_PDL=$mode run python benchmarks/decode_vs_reference.py --modes default --no-reference \
                     --batches 1 64 256 --out "$OUT/pdl-$i-$mode"
             done
             KILN_PDL=2 run python benchmarks/decode_vs_reference.py --modes "O2 inductor-pdl" --no-reference \
                 --batches 1 64 256 --out "$OUT/pdl-5-2-O2" ;;
        # A full garbage collection after start-up, the heap frozen (every engine freezes it at ready) and thawed, default and -O2.
        gc) run python benchmarks/gc_pause_serving.py --device cuda --model llama-3-8b --out "$OUT" ;;
        # The stock torch.compile decode loop's step time (same shape), alone.
        reference) run python benchmarks/reference_decode.py --batches 1 8 64 256 --out "$OUT" ;;
        # Offline throughput: 1000 random prompts, 512 tokens in, 128 out, default and -O2, beside the floor.
        throughput) run python benchmarks/throughput.py --model llama-3-8b --device cuda --modes default O2 --out "$OUT" ;;
        # kiln serve under Poisson arrivals (2, 8, 32 requests/s; 512 in, 128 out): TTFT, TPOT, output tok/s.
        # The image has no FastAPI: carry .whl (bash benchmarks/gpu_wheels.sh makes it).
        serving) if ! python -c "import fastapi" 2>/dev/null; then
                     python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                         --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || status=1
                 fi
                 run python benchmarks/serving.py --model llama-3-8b --device cuda --rates 2 8 32 --num-prompts ${SERVING_PROMPTS:-200} --out "$OUT" ;;
        # Each family's preset (Llama, Mistral, Qwen2.5, Qwen3, Gemma 2): decode at 1 and 64 beside its
        # floor, and -O2's and the default mode's greedy tokens against eager's (about 5 minutes).
        families) run python benchmarks/families.py --out "$OUT" ;;
        # 64 requests sharing a 1,024-token system prompt: TTFT with prefix caching off and on.
        prefix) run python benchmarks/prefix_caching.py --model llama-3-8b --device cuda --out "$OUT" ;;
        # The same with every step timed and the slowest profiled (synchronous scheduling: TTFTs not comparable).
        prefix-steps) run python benchmarks/prefix_caching.py --model llama-3-8b --device cuda --step-times \
                          --out "$OUT/prefix-steps" ;;
        bench) run python -m kiln.cli bench --model llama-3-8b --device cuda --modes eager stock once O2 --out "$OUT" ;;
        # Needs 2 GPUs (nvidia-h200-x2): TP=1 against TP=2, with and without sequence parallelism.
        tp) run python benchmarks/tp_decode.py --out "$OUT" --modes graphs O2 O2+SP --batches 1 64 --timeout 150 ;;
        *) echo "unknown part $part; parts: kernels gemv graphs tiles tiles-large attention attention-sweep partition prefix prefix-steps families engine dynamo cache cache-nopyc fresh fresh-aot first-use profile aot-probe ladder decode pdl gc reference throughput serving bench tp" >&2; exit 2 ;;
    esac
done
exit $status
