# Sourced by the GPU scripts (gpu_list.sh, gpu_streaming.sh) from the project root: installs the
# wheels of ../shared/device/bundle.sh from .whl (unless NO_WHL is set), sets PYTHONPATH, points
# TBA_CACHE at the demo model brought along in .gpucache, and writes the machine to "$OUT/env.txt".
PY=${PYTHON:-python3}
if [ -d .whl ] && [ -z "${NO_WHL:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD
else
  export PYTHONPATH=$PWD/src:$PWD
fi
export PYTHONUNBUFFERED=1
# the demo's warm-started model, when it was brought along (else the demo builds it first)
[ -d .gpucache ] && export TBA_CACHE=$PWD/.gpucache
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  nproc
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
