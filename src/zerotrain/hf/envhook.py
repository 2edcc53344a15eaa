"""`ZEROTRAIN_DEEPSPEED=1`: `import deepspeed` resolves to zerotrain.deepspeed in a
process started by a plain `torchrun train.py`, `accelerate launch train.py` or
`python train.py` — the script and its launcher unchanged.

Python runs no zerotrain code in a process that does not import it, so the switch needs a
start-up hook: a one-line `zerotrain-deepspeed.pth` in the environment's site-packages,
written once per environment by `python -m zerotrain.hf --install-hook` (removed by
`--remove-hook`). At every interpreter start of that environment the line reads one
environment variable and does nothing else unless it is set; with it set to 1 it calls
`zerotrain.hf.install()`, exactly as `-m zerotrain.hf` does. Nothing changes for a
process without the variable, nor in another environment.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

#: the environment variable
VAR = "ZEROTRAIN_DEEPSPEED"
#: the start-up file's name in site-packages
PTH_NAME = "zerotrain-deepspeed.pth"
#: its one line (a .pth line starting with `import` is executed at start-up)
PTH_LINE = (
    f"import os; os.environ.get('{VAR}', '') not in ('', '0') and "
    "__import__('zerotrain.hf.envhook', fromlist=['hook']).hook()\n"
)
_ON = ("1", "true", "yes", "on")


def hook() -> None:
    """Run at start-up when the variable is set: install the alias, or say in one line
    why not (a value other than 1/0, another transformers major) and stop."""
    value = os.environ.get(VAR, "")
    if value.lower() not in _ON:
        print(
            f"zerotrain: error: {VAR}={value!r}: set it to 1 to resolve `import deepspeed` "
            "to zerotrain.deepspeed, or to 0 (or unset it) for the machine's own",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(2)
    import zerotrain.hf

    try:
        zerotrain.hf.install()
    except RuntimeError as e:  # another major version
        print(f"zerotrain: error: {VAR}=1: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def site_dir() -> Path:
    """This interpreter's site-packages (where pip installs zerotrain)."""
    return Path(sysconfig.get_paths()["purelib"])


def install_hook(where: Path | None = None) -> Path:
    """Write the start-up file into `where` (default: this environment's site-packages)."""
    path = (where or site_dir()) / PTH_NAME
    path.write_text(PTH_LINE)
    return path


def remove_hook(where: Path | None = None) -> bool:
    """Remove the start-up file; whether there was one."""
    path = (where or site_dir()) / PTH_NAME
    if path.exists():
        path.unlink()
        return True
    return False
