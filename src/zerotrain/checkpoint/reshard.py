"""Reading a checkpoint cut one way as if it were cut another way.

Each rank saved exactly what it owns — its master-weight range of every unit and the
optimizer state of its optimizer tensors, each tensor flat — plus a table saying which
flat range of which unit each one covers. Where every rank holds everything (stage 0),
each saved its shard of it, so every element is in one file. `SavedShards` indexes
that, so any flat range of any parameter's weights or optimizer state can be read back
— from only the files and byte ranges that hold it (safetensors slices), never whole
files in memory. That gives resharding (another world size or stage: read this rank's
new ranges), export and sampling (read everything), without the model.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from zerotrain.checkpoint.io import (
    CheckpointError,
    rank_files,
    read_json,
    read_meta,
    resolve,
    verify,
)
from zerotrain.config import ModelConfig
from zerotrain.models import EXPORT_FORMAT, export_metadata
from zerotrain.numerics.blockquant import BLOCK, n_blocks

SCALAR_STATES = ("step",)  # every other optimizer state is elementwise
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1}


class SavedShards:
    """Lazy, checksum-verified reader over every rank file of one checkpoint."""

    def __init__(self, ckpt: Path, meta: dict[str, Any]):
        self.ckpt, self.meta = ckpt, meta
        self.where: dict[str, tuple[int, int, int]] = {}  # param -> (unit, offset, numel)
        for ui, unit in enumerate(meta["layout"]["units"]):
            for name, shape, off, _g in unit["params"]:
                self.where[name] = (ui, off, math.prod(shape))
        self.pieces: dict[tuple[str, int], list[tuple[int, int, int, str]]] = defaultdict(list)
        self.scalars: dict[tuple[str, str], Any] = {}  # (state, param) -> value
        self._files: dict[int, Any] = {}
        self.bytes_read = 0
        for r in range(meta["world_size"]):
            self._index_rank(r)

    def _open(self, r: int):
        if r not in self._files:
            st, js = rank_files(self.ckpt, r)
            verify(self.ckpt, self.meta, [st, js])
            self._files[r] = safe_open(str(st), "pt")
        return self._files[r]

    def _index_rank(self, r: int) -> None:
        rmeta = read_json(rank_files(self.ckpt, r)[1])
        units = self.meta["layout"]["units"]
        f = self._open(r)
        for ui, (lo, hi) in enumerate(rmeta["opt_ranges"]):
            self.pieces[("master", ui)].append((lo, hi, r, f"strategy.master.{ui}"))
        for key in list(f.keys()):  # a safetensors handle, not a dict
            if key.startswith("optim."):
                _, idx, name = key.split(".", 2)
                ui, a, b = rmeta["segments"][int(idx)][:3]
                if name in SCALAR_STATES:
                    self._scalar(units[ui], a, b, name, float(f.get_tensor(key)))
                elif name.endswith("~scale"):  # int8 block scales: block coordinates
                    self.pieces[(name, ui)].append((a // BLOCK, n_blocks(b), r, key))
                else:
                    self.pieces[(name, ui)].append((a, b, r, key))
        for key, v in rmeta.get("scalar_state", {}).items():
            idx, name = key.split(".", 1)
            ui, a, b = rmeta["segments"][int(idx)][:3]
            self._scalar(units[ui], a, b, name, v)

    def _scalar(self, unit: dict, a: int, b: int, name: str, value: Any) -> None:
        for pname, shape, off, _g in unit["params"]:
            if off < b and off + math.prod(shape) > a:
                self.scalars[(name, pname)] = value

    def _slice(self, r: int, key: str, x: int, y: int) -> Tensor:
        f = self._open(r)
        sl = f.get_slice(key)
        if len(sl.get_shape()) == 1:
            out = sl[x:y]
        else:  # a tensor saved whole rather than flat (a 0-d state): cut it here
            out = f.get_tensor(key).reshape(-1)[x:y]
        self.bytes_read += out.numel() * out.element_size()
        return out

    def read(self, kind: str, name: str, a: int, b: int) -> Tensor:
        """Flat elements [a, b) of parameter `name`'s weights ("master") or state `kind`.

        Each element is read once. Stage-0 checkpoints saved at N > 1 ranks before the
        replicated state was written once hold N copies of it; those overlapping copies
        are compared and read once (a difference is an error, never a silent choice).
        """
        if name not in self.where:
            raise CheckpointError(f"the checkpoint has no tensor for '{name}'")
        ui, off, _ = self.where[name]
        if kind.endswith("~scale"):  # [a, b) counts blocks (checkpoint/compact.py)
            off //= BLOCK
        lo_, hi_ = off + a, off + b
        parts: list[Tensor] = []
        pos = lo_  # everything before it is read
        for lo, hi, r, key in sorted(self.pieces.get((kind, ui), [])):
            x, y = max(lo_, lo), min(hi_, hi)
            if x >= y:
                continue
            if x > pos:
                break  # a gap no piece covers
            if x < pos:  # another rank's copy of elements already read (see the docstring)
                z = min(y, pos)
                if not torch.equal(torch.cat(parts)[x - lo_:z - lo_],
                                   self._slice(r, key, x - lo, z - lo)):
                    raise CheckpointError(
                        f"the ranks of this checkpoint saved different copies of '{name}' "
                        f"({kind}); it is inconsistent: use another checkpoint (an earlier "
                        "step_* folder)")
            if y > pos:
                parts.append(self._slice(r, key, pos - lo, y - lo))
                pos = y
        if pos != hi_:
            raise CheckpointError(f"the checkpoint has no {kind} state for '{name}'")
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def reader(self, kind: str) -> Callable[[str, int, int], Tensor]:
        return lambda name, a, b: self.read(kind, name, a, b)

    def state_names(self, params: list[str]) -> list[str]:
        """Optimizer state names saved for any of these parameters. A unit can hold tensors
        of different optimizer paths (Muon's matrices, its AdamW fallback), so a name
        counts only where its saved pieces overlap the parameters themselves."""
        spans = [self.where[p] for p in params if p in self.where]
        blocks = [(u, off // BLOCK, n_blocks(n)) for u, off, n in spans]  # int8 scales
        names = {k for (k, ui), pieces in self.pieces.items() if k != "master" and any(
            ui == u and lo < off + n and off < hi
            for u, off, n in (blocks if k.endswith("~scale") else spans)
            for lo, hi, _r, _key in pieces)}
        names |= {k for (k, p) in self.scalars if p in params}
        return sorted(names)

    def rank_tensors(self, r: int, prefix: str) -> dict[str, Tensor]:
        """Rank r's whole tensors named `prefix`… (buffers on rank 0, each rank's RNG)."""
        f = self._open(r)
        keys = list(f.keys())  # a safetensors handle, not a dict
        return {k.removeprefix(prefix): f.get_tensor(k) for k in keys if k.startswith(prefix)}

    def buffers(self) -> dict[str, Tensor]:
        return self.rank_tensors(0, "buffer.")


# ----------------------------------------------------------------------------- full weights


def consolidate(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Full per-parameter master weights (and buffers) from every rank's shards."""
    ckpt = resolve(path)
    meta = read_meta(ckpt)
    saved = SavedShards(ckpt, meta)
    weights: dict[str, Tensor] = {}
    for unit in meta["layout"]["units"]:
        for name, shape, _off, _g in unit["params"]:
            weights[name] = saved.read("master", name, 0, math.prod(shape)).view(shape)
    # buffers, without FP8 layers' amax histories (training state, not part of the model)
    weights.update({k: v for k, v in saved.buffers().items() if ".fp8_" not in k})
    return weights, meta


def full_state_dict(path: str | Path, dtype: torch.dtype | None = torch.float32
                    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A plain `model.state_dict()` (tied names included) from a sharded checkpoint."""
    weights, meta = consolidate(path)
    out = {name: weights[canon] for name, canon in meta["aliases"].items()}
    for k, v in weights.items():
        out.setdefault(k, v)
    if dtype is not None:
        out = {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}
    return out, meta


def export(path: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write consolidated weights as one safetensors file a plain model can load; the
    metadata carries the model config, so the file describes itself."""
    sd, meta = full_state_dict(path, dtype)
    out = Path(out)
    if out.is_dir():
        raise CheckpointError(f"--out '{out}' is a directory; give a file name such as "
                              f"'{out / 'model.safetensors'}'")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    extra = meta.get("extra", {})
    if extra.get("built_from_config"):  # a model zerotrain built: the file describes it
        cfg = ModelConfig.model_validate(meta["config"]["model"])
        metadata = export_metadata(cfg, extra.get("hf_config"), step=meta["global_step"])
    else:  # a user's own nn.Module: only its weights are known here
        metadata = {"format": EXPORT_FORMAT, "step": str(meta["global_step"])}
    try:
        save_file({k: v.contiguous().clone() for k, v in sd.items()}, str(tmp),
                  metadata=metadata)
        tmp.replace(out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out
