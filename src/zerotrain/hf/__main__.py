"""`python -m zerotrain.hf script.py ARGS...`: run the script as `__main__` with
`import deepspeed` resolved to zerotrain.deepspeed (for torchrun -m and
accelerate launch -m; `zerotrain launch` starts its ranks this way)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from zerotrain.hf import install


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m zerotrain.hf script.py [ARGS ...]", file=sys.stderr)
        raise SystemExit(2)
    install()
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))  # as `python script.py` does
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
