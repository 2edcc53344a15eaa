"""Shared by the DeepSpeedExamples stand-ins: where to write each rank's record."""

from __future__ import annotations

import json
import os
from pathlib import Path


def record(out: str, **values) -> None:
    """Write this rank's values (losses, ...) as JSON under `out`."""
    rank = int(os.environ.get("RANK", "0"))
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(values))
