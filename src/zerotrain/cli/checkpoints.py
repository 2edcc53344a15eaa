"""Where `sample` and `export` find a checkpoint: the path given, or a run folder's
`checkpoints/` when the user named the run folder itself."""

from __future__ import annotations

from pathlib import Path


def checkpoint_arg(text: str) -> Path:
    """The checkpoint root or step folder the user meant by `text`."""
    from zerotrain.checkpoint.io import CheckpointError, resolve

    path = Path(text).expanduser()
    try:
        resolve(path)
    except CheckpointError:
        if (path / "checkpoints").is_dir():  # `runs/x` for `runs/x/checkpoints`
            return path / "checkpoints"
        raise
    return path
