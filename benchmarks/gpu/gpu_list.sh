#!/usr/bin/env bash
# ../shared/GPU.md's list on a GPU machine in one command that fits a lease of device time:
# the gpu-marked tests, the demo in both runtimes, and sync against ray at Qwen2.5-0.5B's size
# (benchmarks/bench_gpu.py), each step with its own time limit so a slow or broken one leaves the
# rest standing. Run from the project root, with the wheels of ../shared/device/bundle.sh in .whl:
#
#   BUDGET=540 OUT=/tmp/gpu-list bash benchmarks/gpu/gpu_list.sh
#
# What it keeps lands in $OUT (at most eight files): env.txt, pytest_gpu.txt, demo.txt,
# bench.txt, and runs.tar.gz (every run's metrics, summaries and logs; no weights).
set -u
OUT=${OUT:-runs/gpu-list}
BUDGET=${BUDGET:-540}
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
mkdir -p "$OUT"
work=${WORK:-/tmp/tba-gpu}
DEVICE=${DEVICE:-cuda}
DEMO_ARGS=${DEMO_ARGS:-}    # e.g. "--trainer.steps=20"
BENCH_ARGS=${BENCH_ARGS:-}  # e.g. "--shape tiny --new-tokens 16" for a smoke run on a CPU
mkdir -p "$work"
. benchmarks/gpu/gpu_env.sh

# 1. the gpu tests, while the 0.5B model is built on the CPU
$PY benchmarks/bench_gpu.py --out "$work/bench" --device $DEVICE $BENCH_ARGS --build-only > "$work/build.txt" 2>&1 &
build=$!
echo "== pytest -m gpu ($(left) s left)"
timeout 150 $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_engine.py > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest exit $?"; tail -15 "$OUT/pytest_gpu.txt"
wait $build; cat "$work/build.txt"

# 2. sync against ray at 0.5B, bf16-mixed (the default on a bf16 GPU)
echo "== bench bf16-mixed ($(left) s left)"
$PY benchmarks/bench_gpu.py --out "$work/bench" --device $DEVICE $BENCH_ARGS --precisions bf16-mixed --deadline $(($(left) - 240)) > "$OUT/bench.txt" 2>&1
tail -8 "$OUT/bench.txt"

# 3. the demo, both runtimes
for rt in sync ray; do
  lim=$(($(left) / 2 - 40)); [ "$rt" = ray ] && lim=$(($(left) - 100))
  echo "== demo $rt ($(left) s left, limit $lim s)"
  s0=$(date +%s)
  timeout $lim $PY -m tba.cli train --run.device=$DEVICE $DEMO_ARGS --runtime.type=$rt \
    --run.output_dir="$work/demo" --run.name=demo-$rt --logging.progress=false >> "$OUT/demo.txt" 2>&1
  echo "demo $rt: exit $?, $(($(date +%s) - s0)) s" >> "$OUT/demo.txt"
  $PY -c "import json,sys; s=json.load(open(sys.argv[1])); print({k: s.get(k) for k in ('eval/accuracy_initial','eval/accuracy_final','wall_clock_s','trainer_steps','trainer_busy_fraction','peak_memory_gb','lag_mean')})" "$work/demo/demo-$rt/summary.json" >> "$OUT/demo.txt" 2>&1
  tail -3 "$OUT/demo.txt"
done

# 4. fp32 at 0.5B with what is left
echo "== bench fp32 ($(left) s left)"
$PY benchmarks/bench_gpu.py --out "$work/bench" --device $DEVICE $BENCH_ARGS --precisions fp32 --deadline $(($(left) - 25)) >> "$OUT/bench.txt" 2>&1
tail -6 "$OUT/bench.txt"

tar -czf "$OUT/runs.tar.gz" -C "$work" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' \
  --exclude='model' --exclude='checkpoints' . 2>/dev/null
ls -la "$OUT"; echo "done in $(($(date +%s) - start)) s"
