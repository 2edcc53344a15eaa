#!/usr/bin/env bash
# The one-call GPU check (issue 21, docs/gpu-check.md): what a single lent GPU can prove,
# in <= 8 minutes.
#   bash bench/gpu_check.sh [--dry-run] [--budget S] [--sections env probes ...]
#                           [--out DIR] [--wheels DIR] [--preset llama-1b]
# Sections, each with its own time cap, in this order; the default (one GPU, 450 s of caps
# = the default budget) is env .. pytest; --sections adds cli, stages (>= 2 GPUs) and perf,
# and the caps of what is asked for are scaled to fit the budget together:
#   env, setup, probes, review3, race, fp8, init_mem, pytest | cli, stages, perf
# (bench/gpu_check.py says what each one proves). A failure or a hang costs its own
# section only; the table says which claims one GPU cannot test ("needs >= 2 GPUs").
# Results: --out, else $GPU_CHECK_OUT, else $OUT (the device tool's return folder), else
# bench/results/gpu_check: gpu_check.md (table), gpu_check.json, gpu_check.log.
#
# Python: $PYTHON, else the first of python3 / .venv/bin/python / python whose torch
# sees a GPU (any torch with --dry-run). zerotrain runs from src/. Its other needs
# (pyproject.toml) and pytest are checked first; what is missing is installed into a
# venv (pip -c constraints.txt) from the package index, or offline from --wheels DIR /
# $ZEROTRAIN_WHEELS / .whl. Where pip works, this fetches the wheels a GPU image lacks:
#   bash bench/gpu_check.sh --fetch-wheels     (WHEEL_PY=3.12 by default)
# The one-call recipe (one H200, no network there, 15 device-minutes for a call and a rerun):
#   1. here:  bash bench/gpu_check.sh --fetch-wheels      (creates .whl/, git-ignored)
#   2. here:  bash bench/gpu_check.sh --dry-run           (optional: the script on CPU)
#   3. device: run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=510)
#   4. give_back at once, unless a rerun follows (450 s of sections + ~60 s of start-up).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fetch-wheels" ]; then
  # pydantic and its three helpers: what the device image lacks of pyproject's needs
  ${PYTHON:-python3} -m pip download -q --no-deps --only-binary=:all: \
    --python-version "${WHEEL_PY:-3.12}" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    || exit 1
  excl=$(git rev-parse --git-path info/exclude)  # never committed: carried by hand
  grep -qx '/.whl/' "$excl" 2>/dev/null || echo '/.whl/' >> "$excl"
  ls .whl
  echo 'now: run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=510)'
  exit 0
fi
DRY=0
for a in "$@"; do [ "$a" = "--dry-run" ] && DRY=1; done

has_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() or '"$DRY"' else 1)' \
  >/dev/null 2>&1; }
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3 .venv/bin/python python; do
    if command -v "$c" >/dev/null 2>&1 && has_torch "$c"; then PY=$(command -v "$c"); break; fi
  done
fi
if [ -z "$PY" ]; then  # the driver still writes the table: env says what is wrong
  for c in python3 python; do command -v "$c" >/dev/null 2>&1 && { PY=$(command -v "$c"); break; }; done
fi
if [ -z "$PY" ]; then
  echo "gpu_check: no python3 on PATH (set PYTHON=...)" >&2
  exit 1
fi
export PYTHONUNBUFFERED=1
exec "$PY" bench/gpu_check.py "$@"
