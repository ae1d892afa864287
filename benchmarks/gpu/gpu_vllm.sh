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
# Four parts instead of five (the H200 lease, 2026-11-28): also drop vllm/_moe_C_stable_libtorch.abi3.so
# from the vLLM wheel (39 MiB; MoE kernels only, its import is optional) and its RECORD line, as
# make_parts.sh drops FA2, keep one copy of the wheels both sets hold (pydantic, pydantic-core,
# annotated-types, typing-*, dill), and split -b 50000000: 175 MiB in four parts, each beside a
# 12 MB repository within the 64 MiB a call carries: calls 1-3 carry part00-02, call 4 part03 with
# the sha256 (and .gpusrc) and runs the script.
# There, calls back to back (each within 30 s of the last, or /tmp is gone):
#   calls 1-4: carry [".vparts/tbagpu.tar.partNN"]   command: mkdir -p /tmp/vparts && cp .vparts/* /tmp/vparts/
#   call 5:    carry [".vparts/tbagpu.tar.part04", ".vparts/tbagpu.tar.sha256"]
#              command: mkdir -p /tmp/vparts && cp .vparts/* /tmp/vparts/ && BUDGET=560 OUT=$OUT bash benchmarks/gpu/gpu_vllm.sh
# With a frozen copy of the tree (git archive HEAD into the ignored .gpusrc, carried with the last
# part): cd .gpusrc && ... bash benchmarks/gpu/gpu_vllm.sh, so edits made meanwhile do not travel.
#
# Kept in $OUT: env.txt, pytest_gpu.txt, bench.txt (progress and the tables), runs.tar.gz (every
# run's metrics, summary, plan and log; no weights); with "gen": generation.txt, generation.json.
# Options: ITEMS (what to run, in order; default "pytest bench"; also "gen": vLLM generation tokens/s
# at IN_FLIGHT sequences at once ("8 32 128 512"), one eager bf16 engine over the 0.5B model,
# GEN_PROMPT_LEN (32) + GEN_TOKENS (128) tokens, K = 8 samples a prompt; "stream": streaming against
# batch searchers with vLLM at 0.5B, 16-512 tokens, K = 2 and 8, SECONDS_PER_WAY each (45); "packing":
# bench_packing.py on the GPU; "demo": the demo with vLLM in the sync runtime), BENCH_ARGS (e.g.
# "--shape tiny --new-tokens 8" for a smoke run on a CPU with DEVICE=cpu), STEPS (8), ARMS (the bench
# item's runs, in order: "ray-ipc sync ray-os" by default), PYTEST_K (a -k expression: run only the
# tests it names), PYTEST_TIMEOUT (150 s), GEN_TIMEOUT (240 s).
set -u
OUT=${OUT:-runs/gpu-vllm}
BUDGET=${BUDGET:-560}
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
mkdir -p "$OUT"
PARTS=${PARTS:-/tmp/vparts}
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-8}
ITEMS=" ${ITEMS:-pytest bench} "
ARMS=${ARMS:-ray-ipc sync ray-os}
IN_FLIGHT=${IN_FLIGHT:-8 32 128 512}
SECONDS_PER_WAY=${SECONDS_PER_WAY:-45}
wants() { [[ "$ITEMS" == *" $1 "* ]]; }
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
if wants pytest; then
  echo "== pytest -m gpu ${PYTEST_K:+-k \"$PYTEST_K\" }($(left) s left)"
  timeout "${PYTEST_TIMEOUT:-150}" $PY -m pytest -m gpu -q -p no:cacheprovider -rA ${PYTEST_K:+-k "$PYTEST_K"} \
    tests/test_gpu.py tests/test_gpu_engine.py > "$OUT/pytest_gpu.txt" 2>&1
  echo "pytest exit $?"; tail -15 "$OUT/pytest_gpu.txt"
fi
wait $build; cat "$work/build.txt" | tail -2

# 1b. vLLM generation alone: tokens/s at each number of sequences in flight, one engine for all
if wants gen; then
  echo "== generation sweep, in flight: $IN_FLIGHT ($(left) s left)"
  timeout "${GEN_TIMEOUT:-240}" $PY benchmarks/bench_generation.py --backends vllm --device $DEVICE --dtype bfloat16 \
    --model "$work/bench/model" --enforce-eager --k 8 --prompt-len "${GEN_PROMPT_LEN:-32}" \
    --new-tokens "${GEN_TOKENS:-128}" --repeats 2 --in-flight $IN_FLIGHT --verbose --out "$work/gen" \
    > "$OUT/generation.txt" 2>&1
  echo "exit $?"; grep -v "^INFO\|^WARNING\|Loading" "$OUT/generation.txt" | tail -14
  cp "$work/gen/results.json" "$OUT/generation.json" 2>/dev/null
fi

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
if wants bench; then
  arms=($ARMS); n=${#arms[@]}; i=0
  for arm in $ARMS; do  # each arm gets an equal share of what is left, the last one nearly all of it
    i=$((i + 1)); share=$((i == n ? 92 : 100 / (n - i + 1)))
    case $arm in
      ray-ipc) bench ray -vllm-ipc $share --runtime.weight_transport=ipc ;;
      sync) bench sync -vllm $share ;;
      ray-os) bench ray -vllm-os $share --runtime.weight_transport=object_store ;;
      *) echo "unknown arm $arm" ;;
    esac
  done
fi

# 3. streaming against batch searchers on the engine, long-tailed lengths (GPU.md item 4)
if wants stream; then
  for k in 2 8; do
    echo "== bench_streaming vllm K=$k ($(left) s left)"
    timeout $((2 * SECONDS_PER_WAY + 150)) $PY benchmarks/bench_streaming.py --backend vllm --model qwen0.5b \
      --device $DEVICE --dtype bfloat16 --slots 16 --group-size $k --min-len 16 --max-len 512 \
      --seconds "$SECONDS_PER_WAY" --out "$work/streaming" >> "$OUT/bench_streaming.txt" 2>&1
    echo "exit $?"; grep -v Loading "$OUT/bench_streaming.txt" | tail -2
  done
fi

# 4. packed against padded trainer steps on the GPU (GPU.md item 5)
if wants packing; then
  echo "== bench_packing ($(left) s left)"
  timeout $(($(left) - 60)) $PY benchmarks/bench_packing.py --device $DEVICE --rounds 1 > "$OUT/bench_packing.txt" 2>&1
  echo "exit $?"; tail -8 "$OUT/bench_packing.txt"
fi

# 5. the demo with vLLM searchers, the sync runtime (engine asleep while the trainer steps)
if wants demo; then
  echo "== demo, vLLM, sync ($(left) s left)"
  timeout $(($(left) - 40)) $PY -m tba.cli train --run.device=$DEVICE --generation.backend=vllm --runtime.type=sync \
    --run.output_dir="$work/demo" --run.name=demo-vllm --logging.progress=false > "$OUT/demo_vllm.txt" 2>&1
  echo "exit $?"; tail -12 "$OUT/demo_vllm.txt"
fi

tar -czf "$OUT/runs.tar.gz" -C "$work" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' \
  --exclude='model' --exclude='checkpoints' . 2>/dev/null
ls -la "$OUT"; echo "done in $(($(date +%s) - start)) s"
