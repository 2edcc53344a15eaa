"""`python -m zerotrain.hf script.py ARGS...`: run the script as `__main__` with
`import deepspeed` resolved to zerotrain.deepspeed (for torchrun -m and
accelerate launch -m; `zerotrain launch` starts its ranks this way).

`python -m zerotrain.hf --install-hook` (once per environment) lets `ZEROTRAIN_DEEPSPEED=1`
do the same for a script started any other way (`envhook.py`); `--remove-hook` undoes it.

A configuration zerotrain cannot run (a DeepSpeed key it cannot honour, an unsupported
transformers / Accelerate / TRL major) ends the run with one line, said by rank 0, before
any rank trains."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from zerotrain.config.base import ConfigError
from zerotrain.hf import install


def _refuse(err: Exception) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"zerotrain: error: {err}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def _hook(flag: str) -> None:
    from zerotrain.hf import envhook

    if flag == "--install-hook":
        path = envhook.install_hook()
        print(
            f"wrote {path}: with {envhook.VAR}=1 in the environment, `import deepspeed` "
            "resolves to zerotrain.deepspeed in every Python process of this environment "
            "(torchrun, accelerate launch, python); without it nothing changes"
        )
    else:
        gone = envhook.remove_hook()
        print(
            f"removed {envhook.site_dir() / envhook.PTH_NAME}"
            if gone
            else "no start-up hook was installed in this environment"
        )


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: python -m zerotrain.hf script.py [ARGS ...]\n"
            "       python -m zerotrain.hf --install-hook | --remove-hook",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if argv[0] in ("--install-hook", "--remove-hook"):
        _hook(argv[0])
        return
    try:
        install()
    except RuntimeError as e:  # another major version, or the real deepspeed imported
        _refuse(e)
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))  # as `python script.py` does
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except ConfigError as e:  # the DeepSpeed config, refused by name in initialize
        _refuse(e)


if __name__ == "__main__":
    main(sys.argv[1:])
