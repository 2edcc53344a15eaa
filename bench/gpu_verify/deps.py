"""Which of zerotrain's needs this Python lacks: bench/gpu_check.sh, section setup.

    python bench/gpu_verify/deps.py [--pretend-missing NAME ...]

Reads [project].dependencies from pyproject.toml (the tracked source of truth), adds
pytest (the gpu-marked tests), and prints one JSON object: {"python", "torch",
"present": {name: version}, "missing": [requirement, ...]}. torch is never in "missing"
as a thing to install: the GPU machine's own CUDA build must be the one used.
Standard library only, so it runs before anything is installed. `--pretend-missing`
treats NAME as absent (the dry-run test of the install path).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMPORT_NAMES = {"pyyaml": "yaml"}  # distribution name -> module, where they differ
EXTRA = ["pytest>=8"]  # `pytest -m gpu`; from the dev extra


def requirements() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return [*deps, *EXTRA]


def dist_name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pretend-missing", nargs="*", default=[])
    a = p.parse_args()
    present, missing = {}, []
    torch_info: dict = {"torch": None}
    for req in requirements():
        name = dist_name(req)
        module = IMPORT_NAMES.get(name.lower(), name.replace("-", "_"))
        found = name not in a.pretend_missing and importlib.util.find_spec(module) is not None
        if name == "torch":
            torch_info = {"torch": md.version("torch") if found else None}
            continue
        if found:
            try:
                present[name] = md.version(name)
            except md.PackageNotFoundError:
                present[name] = "?"
        else:
            missing.append(req)
    print(json.dumps({"python": sys.executable, **torch_info, "present": present,
                      "missing": missing}))


if __name__ == "__main__":
    main()
