"""Sharded, atomic checkpoints of Stateful objects, and what can be read back from them.

- `io`: the directory protocol (atomic rename, `latest`, checksums, pruning).
- `state`: `save(state_dict, ...)` / `load(path, template, rank)` for an engine-shaped
  state dict, with the resume rules (what comes from the checkpoint, what from config).
- `reshard`: read any range of any parameter back from every rank's files: resharding,
  consolidation, export.
"""

from zerotrain.checkpoint.io import CheckpointError, resolve
from zerotrain.checkpoint.reshard import consolidate, export, full_state_dict
from zerotrain.checkpoint.state import Loaded, load, save

__all__ = ["CheckpointError", "Loaded", "consolidate", "export", "full_state_dict", "load",
           "resolve", "save"]
