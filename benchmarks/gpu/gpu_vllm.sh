#!/usr/bin/env bash
# vLLM on a GPU in one command that fits a lease of device time (../shared/GPU.md's list, items 1-3,
# and issue 53's GPU points): installs the bundle brought in parts (vLLM 0.26 and what it needs,
# Ray, pydantic, jsonschema, datasets), runs the gpu-marked tests (the vLLM ones, and the CUDA IPC
# transport across processes), then benchmarks/bench_gpu.py at Qwen2.5-0.5B's size with vLLM
# searchers: the ray runtime with weights by CUDA IPC, the sync runtime (its engine sleeps while
# the trainer steps), and the ray runtime with weights by the object store. Each step has its own
# time limit, so a slow or broken one leaves the rest standing.
#
# Here, once (the parts: ~214 MiB in five of 44 MiB, one per call beside the repository):
#   echo /.vparts/ >> .git/info/exclude
#   ../shared/device/vllm/make_parts.sh /tmp/vraw 400M; ../shared/device/bundle.sh .whl
#   then tar vLLM's bundle/ with the .whl wheels it lacks into tbagpu.tar, split -b 44M into
#   .vparts/tbagpu.tar.partNN, and write its sha256 (as "<sum>  b.tar") to .vparts/tbagpu.tar.sha256
# There, calls back to back (each within 30 s of the last, or /tmp is gone):
#   calls 1-4: carry [".vparts/tbagpu.tar.partNN"]   command: mkdir -p /tmp/vparts && cp .vparts/* /tmp/vparts/
#   call 5:    carry [".vparts/tbagpu.tar.part04", ".vparts/tbagpu.tar.sha256"]
#              command: mkdir -p /tmp/vparts && cp .vparts/* /tmp/vparts/ && BUDGET=560 OUT=$OUT bash benchmarks/gpu/gpu_vllm.sh
#
# Kept in $OUT: env.txt, pytest_gpu.txt, bench.txt (progress and the tables), runs.tar.gz (every
# run's metrics, summary, plan and log; no weights).
# Options: BENCH_ARGS (e.g. "--shape tiny --new-tokens 8" for a smoke run on a CPU with DEVICE=cpu),
# SKIP_PYTEST=1, STEPS (8).
set -u
OUT=${OUT:-runs/gpu-vllm}
BUDGET=${BUDGET:-560}
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
mkdir -p "$OUT"
PARTS=${PARTS:-/tmp/vparts}
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-8}
BENCH_ARGS=${BENCH_ARGS:-}
work=${WORK:-/tmp/tba-gpu-vllm}
mkdir -p "$work"
PY=${PYTHON:-python3}

if ls "$PARTS"/tbagpu.tar.part?? > /dev/null 2>&1; then
  echo "== install ($(left) s left)"
  (cd "$PARTS" && cat tbagpu.tar.part?? > b.tar && sha256sum -c tbagpu.tar.sha256 && tar -xf b.tar \
    && cd bundle && sha256sum -c --quiet SHA256SUMS) || exit 1
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$PARTS"/bundle/*.whl || exit 1
fi
NO_WHL=1 . benchmarks/gpu/gpu_env.sh
export PYTHONPATH=/tmp/site:$PWD/src:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
$PY -c "import vllm, ray; print('vllm', vllm.__version__, 'ray', ray.__version__)" >> "$OUT/env.txt" 2>&1
tail -1 "$OUT/env.txt"

# 1. the gpu tests (vLLM's included), while the 0.5B model is built on the CPU
$PY benchmarks/bench_gpu.py --out "$work/bench" --device $DEVICE $BENCH_ARGS --build-only > "$work/build.txt" 2>&1 &
build=$!
if [ -z "${SKIP_PYTEST:-}" ]; then
  echo "== pytest -m gpu ($(left) s left)"
  timeout 150 $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_engine.py \
    > "$OUT/pytest_gpu.txt" 2>&1
  echo "pytest exit $?"; tail -15 "$OUT/pytest_gpu.txt"
fi
wait $build; cat "$work/build.txt" | tail -2

# 2. sync against ray at 0.5B with vLLM searchers (eager: no compile in a short lease), equal steps
vllm="--generation.backend=vllm --generation.vllm.enforce_eager=true"
bench() {  # runtime, tag, deadline share of what is left, extra overrides
  local rt=$1 tag=$2 share=$3; shift 3
  local dl=$(($(left) * share / 100))
  echo "== $rt$tag ($(left) s left, deadline $dl s)"
  $PY benchmarks/bench_gpu.py --out "$work/bench" --device $DEVICE $BENCH_ARGS --precisions bf16-mixed \
    --runtimes $rt --steps $STEPS --tag="$tag" --deadline $dl $vllm "$@" >> "$OUT/bench.txt" 2>&1
  tail -4 "$OUT/bench.txt"
}
bench ray -vllm-ipc 40 --runtime.weight_transport=ipc
bench sync -vllm 55
bench ray -vllm-os 92 --runtime.weight_transport=object_store

tar -czf "$OUT/runs.tar.gz" -C "$work" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' \
  --exclude='model' --exclude='checkpoints' . 2>/dev/null
ls -la "$OUT"; echo "done in $(($(date +%s) - start)) s"
