#!/usr/bin/env bash
# Issue 39's GPU points in one command that fits a lease: the gpu-marked tests (../shared/GPU.md's
# first item), batch against continuous generation on the engine (benchmarks/bench_streaming.py,
# HF backend: the GPU machine has no vLLM) at Qwen2.5-0.5B's shape and up to 512 new tokens, and
# the demo in the ray runtime with batch and with streaming searchers. Run from the project root
# with the wheels of ../shared/device/bundle.sh in .whl and the demo's model in .gpucache:
#
#   BUDGET=540 OUT=/tmp/gpu-streaming bash benchmarks/gpu/gpu_streaming.sh
#
# SKIP_PYTEST=1 leaves the tests out; HF_STREAM=refill measures refill batches instead of
# transformers' continuous batching; SECONDS_PER_WAY (default 60) per way of the engine bench;
# DEMO_MODES="true" runs only the streaming demo.
set -u
OUT=${OUT:-runs/gpu-streaming}
BUDGET=${BUDGET:-540}
SECONDS_PER_WAY=${SECONDS_PER_WAY:-60}
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
mkdir -p "$OUT"
. benchmarks/gpu/gpu_env.sh

if [ -z "${SKIP_PYTEST:-}" ]; then
  echo "== pytest -m gpu ($(left) s left)"
  timeout 120 $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_engine.py > "$OUT/pytest_gpu.txt" 2>&1
  echo "pytest exit $?"; tail -5 "$OUT/pytest_gpu.txt"
fi

echo "== bench_streaming, hf, qwen0.5b, bf16, 16-512 tokens ($(left) s left)"
timeout $((2 * SECONDS_PER_WAY + 100)) $PY benchmarks/bench_streaming.py --backend hf --model qwen0.5b --device cuda \
  --dtype bfloat16 --slots 16 --refill 4 --hf-stream "${HF_STREAM:-continuous}" --max-len 512 --seconds "$SECONDS_PER_WAY" --out "$OUT" > "$OUT/bench_streaming.txt" 2>&1
echo "exit $?"; grep -v Loading "$OUT/bench_streaming.txt" | tail -4

for mode in ${DEMO_MODES:-false true}; do
  lim=$(( $(left) / 2 - 10 )); [ "$mode" = true ] && lim=$(( $(left) - 15 ))
  echo "== demo, ray, generation.stream=$mode ($(left) s left, limit $lim s)"
  s0=$(date +%s)
  timeout $lim $PY -m tba.cli train --run.device=cuda --runtime.type=ray --generation.stream=$mode \
    --run.output_dir=/tmp/demo --run.name=stream-$mode --logging.progress=false > "$OUT/demo_stream_$mode.txt" 2>&1
  echo "exit $? in $(( $(date +%s) - s0 )) s"; grep -E "accuracy|wall|steps/s" "$OUT/demo_stream_$mode.txt" | tail -4
  cp /tmp/demo/stream-$mode/summary.json "$OUT/demo_stream_${mode}_summary.json" 2>/dev/null
  tail -n 3 /tmp/demo/stream-$mode/metrics.jsonl > "$OUT/demo_stream_${mode}_metrics_tail.jsonl" 2>/dev/null
done
