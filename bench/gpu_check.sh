#!/usr/bin/env bash
# The GPU check of issues 13 and 18, on whatever GPUs this machine has, in under 8 minutes:
#   bash bench/gpu_check.sh [--dry-run] [--budget S] [--preset llama-1b] [--sections ...]
# 1. `pytest -m gpu` (tests/test_gpu.py: one GPU every stage and Offload, sample and
#    resume; NCCL with 2+ GPUs);
# 2. bench/gpu_check.py: every stage at the GPU count against one process, the CLI
#    (ZeRO-3 bf16, resume, sample), zerotrain vs FSDP2 on a 1.1B model, FP8.
# Results: $GPU_CHECK_OUT, else $OUT (the device tool's return folder), else
# bench/results/gpu_check: gpu_check.md (table), gpu_check.json, pytest.txt, gpu_check.log.
#
# Python: $PYTHON, else the first of python3 / .venv/bin/python whose torch sees CUDA.
# zerotrain runs from src/ (no install). Its pure-Python needs (pydantic, pyyaml, tqdm,
# safetensors, numpy, matplotlib) must import; on a machine without a package registry
# put their wheels in .whl/ and they are installed to a private folder first:
#   bash bench/gpu_check.sh --fetch-wheels     (where pip works; WHEEL_PY=3.12 by default)
# downloads the ones the device image lacks (pydantic and its three helpers, 2.7 MB).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fetch-wheels" ]; then
  ${PYTHON:-python3} -m pip download -q --no-deps --only-binary=:all: \
    --python-version "${WHEEL_PY:-3.12}" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    || exit 1
  excl=$(git rev-parse --git-path info/exclude)  # never committed, carried by hand
  grep -qx '/.whl/' "$excl" 2>/dev/null || echo '/.whl/' >> "$excl"
  ls .whl; exit 0
fi
OUT_DIR=${GPU_CHECK_OUT:-${OUT:-bench/results/gpu_check}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
export GPU_CHECK_OUT=$OUT_DIR PYTHONUNBUFFERED=1
DRY=0
for a in "$@"; do [ "$a" = "--dry-run" ] && DRY=1; done

has_cuda() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3 .venv/bin/python python; do
    if command -v "$c" >/dev/null 2>&1 && { [ $DRY = 1 ] || has_cuda "$c"; }; then PY=$c; break; fi
  done
fi
if [ -z "$PY" ]; then
  echo "gpu_check: no python whose torch sees a CUDA device (set PYTHON=...; --dry-run runs on CPU)" >&2
  exit 1
fi

export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c 'import pydantic, yaml, tqdm, safetensors, numpy, matplotlib' 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/zerotrain-site .whl/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/zerotrain-site"
  fi
  if ! "$PY" -c 'import pydantic, yaml, tqdm, safetensors, numpy, matplotlib'; then
    echo "gpu_check: zerotrain's dependencies do not import with $PY; run" \
         "'bash bench/gpu_check.sh --fetch-wheels' where pip works and bring .whl/ along" >&2
    exit 1
  fi
fi
"$PY" -c 'import torch; print("gpu_check:", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count())'

status=0
start=$(date +%s)
echo "gpu_check: pytest -m gpu"
timeout 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT_DIR/pytest.txt"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && status=1   # 5: nothing collected/selected
used=$(( $(date +%s) - start ))
budget=$(( 440 - used ))
[ $budget -lt 120 ] && budget=120
"$PY" bench/gpu_check.py --out "$OUT_DIR" --budget "$budget" "$@" || status=1
echo "gpu_check: pytest -m gpu exit $rc; total $(( $(date +%s) - start )) s; results in $OUT_DIR"
exit $status
