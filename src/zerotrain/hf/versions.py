"""The Hugging Face libraries `zerotrain.hf` is tested with, and the check that refuses
other major versions before any rank starts training."""

from __future__ import annotations

import importlib.metadata

#: distribution -> the version tested (docs/hf.md; pinned by the `hf` extra)
TESTED: dict[str, str] = {"transformers": "5.24.0", "accelerate": "1.16.0", "trl": "1.16.0"}


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_versions(versions: dict[str, str | None] | None = None) -> None:
    """One line naming the first library whose major version differs from the tested one
    (absent libraries are fine: a plain DeepSpeed script needs none of them)."""
    found = versions if versions is not None else {d: installed_version(d) for d in TESTED}
    for dist, have in found.items():
        want = TESTED[dist]
        if have is not None and have.split(".")[0] != want.split(".")[0]:
            raise RuntimeError(
                f"{dist} {have} is not supported by zerotrain.hf (tested with {dist} {want}; "
                f"other major versions are refused): pip install 'zerotrain[hf]' installs "
                f"{dist}=={want}")
