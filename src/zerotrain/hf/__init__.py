"""Hugging Face Trainer, Accelerate and TRL on zerotrain, with the script unchanged.

transformers and Accelerate drive DeepSpeed themselves (`import deepspeed`,
`deepspeed.initialize`, `deepspeed.zero.Init`, the engine's methods). `install()` makes
every `import deepspeed` in this process (by transformers, Accelerate, TRL or the
script) resolve to `zerotrain.deepspeed`, with the distribution metadata those
libraries check, and says so once on rank 0. It changes nothing outside the process.

    zerotrain launch --nproc 2 train.py --deepspeed ds_config.json   # does it for you
    torchrun --nproc-per-node 2 -m zerotrain.hf train.py ...         # the same, any launcher
    accelerate launch -m zerotrain.hf train.py ...                   # the same
    import zerotrain.hf; zerotrain.hf.install()                      # first lines of a script

What is covered, and what is refused with which message: docs/hf.md.
"""

from __future__ import annotations

import os
import sys

from zerotrain.hf import alias
from zerotrain.hf.versions import TESTED, check_versions

__all__ = ["TESTED", "install", "installed", "uninstall"]

def installed() -> bool:
    """Whether `import deepspeed` resolves to zerotrain.deepspeed in this process."""
    return alias.installed()


def install(quiet: bool = False) -> None:
    """Make `import deepspeed` resolve to `zerotrain.deepspeed` for this process.

    Call it before transformers decides whether DeepSpeed is available (before building
    `TrainingArguments(deepspeed=...)`); a real `deepspeed` imported earlier is refused.
    """
    if alias.installed():
        return
    check_versions()
    real = sys.modules.get("deepspeed")
    if real is not None and not isinstance(real, alias.AliasModule):
        raise RuntimeError("zerotrain.hf.install(): the real deepspeed is already imported "
                           "in this process; call install() (or start with `zerotrain launch`"
                           " / `-m zerotrain.hf`) before anything imports deepspeed")
    stale = sys.modules.get("transformers.integrations.deepspeed")
    alias.add()
    if stale is not None and not getattr(stale, "is_deepspeed_available", lambda: True)():
        # transformers looked before the finder was there: let it look again
        del sys.modules["transformers.integrations.deepspeed"]
    if not quiet and os.environ.get("RANK", "0") == "0":
        print(f"[zerotrain] `import deepspeed` resolves to zerotrain.deepspeed (DeepSpeed "
              f"{alias.DEEPSPEED_VERSION}'s API) in this run; nothing else on the machine "
              "changes", flush=True)


def uninstall() -> None:
    """Undo `install()` (tests): `import deepspeed` finds what the machine has again."""
    alias.remove()
