#!/usr/bin/env bash
# Create .venv-bench: a separate virtual environment for bench/peers.py, holding
# zerotrain (editable), the pinned CPU torch, DeepSpeed (installed --no-deps so it can
# never replace torch) and the few packages DeepSpeed really imports, transformers (the
# long-sequence peers' models), plus py-spy for profiling. The project's own .venv is left untouched.
#
#   bash bench/setup_peers.sh            # create or update .venv-bench
#   VENV=/tmp/venv-bench bash bench/setup_peers.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-bench}"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
TORCH_VERSION="2.13.0"          # the CPU build on local disk; never leave torch unpinned
DEEPSPEED_VERSION="0.19.8"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet)

"${PIP[@]}" --upgrade pip setuptools wheel
"${PIP[@]}" "torch==$TORCH_VERSION"
# zerotrain itself, with torch pinned so its `torch>=2.4` cannot pull another build.
"${PIP[@]}" "torch==$TORCH_VERSION" -e "$ROOT"
# What DeepSpeed imports at run time (its requirements.txt minus torch).
"${PIP[@]}" "torch==$TORCH_VERSION" einops hjson msgpack ninja numpy "packaging>=20" psutil \
    py-cpuinfo "pydantic>=2" tqdm
# DeepSpeed is an sdist: build it against the venv's torch (no isolated build env that
# could fetch a different torch), install no dependencies, compile no ops ahead of time
# (CPU ops are JIT-built by ninja on first use, if a config needs them).
DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "${PIP[@]}" --no-deps --no-build-isolation \
    "deepspeed==$DEEPSPEED_VERSION"
# The Hugging Face models the peers train (bench/longctx.py: FSDP2 and DeepSpeed on an HF
# Llama with HF activation checkpointing), torch pinned so it cannot pull another build.
"${PIP[@]}" "torch==$TORCH_VERSION" "transformers>=4.40"
# Profiling tools for the report in bench/README.md.
"${PIP[@]}" py-spy

# Check the pins, and JIT-build (ninja + gcc, cached in ~/.cache/torch_extensions) the two
# C++ ops DeepSpeed's CPU accelerator loads, so no benchmark run pays ~40 s for them:
# the shared-memory comm op every engine loads at start, and CPU Adam (ds-*-off rows).
DS_ACCELERATOR=cpu "$VENV/bin/python" - <<'EOF'
import torch
import deepspeed
from deepspeed.accelerator import get_accelerator
import zerotrain
assert torch.__version__.startswith("2.13.0"), torch.__version__
for name in ("ShareMemCommBuilder", "CPUAdamBuilder"):
    builder = get_accelerator().create_op_builder(name)
    try:
        builder.load(verbose=False)
        print(f"built {name}")
    except Exception as e:  # a missing op only disables the rows that need it
        print(f"could not build {name}: {e}")
print(f"ok: torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
      f"zerotrain {zerotrain.__version__}")
EOF
