"""Reading pretrained weights a slice at a time, so no process ever holds the whole model.

`SafetensorsIndex` knows where every tensor of a safetensors checkpoint lives (one file,
a Hugging Face folder sharded with `model.safetensors.index.json`, or zerotrain's own
export) from the files' headers alone, and `read_slice(name, start, stop)` returns elements
[start, stop) of the *flattened* tensor by reading only the rows that cover them
(`safe_open(...).get_slice`): a ZeRO rank that owns a flat range reads that range and a
row's worth at each end, never the file. `bytes_read` counts what was read, so tests can
hold the loader to it.

`bind` matches a model's parameters to stored tensors (a tied parameter matches under any
of its names; a stored tensor may be the transpose, as GPT-2's Conv1D weights are) and
reports every missing or wrongly shaped tensor in one error. `Weights` is the pair; its
`read_slice` takes the model's own parameter names.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from zerotrain.models.moe_parallel import whole_shapes

#: safetensors dtype codes -> bytes per element
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
INDEX_FILE = "model.safetensors.index.json"


class WeightError(ValueError):
    """Pretrained weights that do not fit the model (missing, mis-shaped, unreadable)."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors code, e.g. "F32"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Tensor table and metadata of one safetensors file, from its JSON header only."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise WeightError(f"'{path}' is not a readable safetensors file ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    return {k: TensorInfo(path, tuple(v["shape"]), v["dtype"]) for k, v in header.items()}, meta


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a file or folder (index first, else every *.safetensors)."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise WeightError(f"weights '{p}' do not exist; give a .safetensors file or a folder")
    index = p / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [p / f for f in sorted(set(weight_map.values()))]
    return sorted(p.glob("*.safetensors"))


class SafetensorsIndex:
    """{stored name: (file, shape, dtype)} over one or several safetensors files."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        files = weight_files(self.path)
        if not files:
            raise WeightError(f"folder '{self.path}' holds no .safetensors weights")
        self.entries: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        for f in files:
            if not f.is_file():
                raise WeightError(f"'{f}' is listed in {INDEX_FILE} but missing")
            table, meta = read_header(f)
            self.metadata.update(meta)
            for name, info in table.items():
                if name in self.entries:
                    raise WeightError(f"tensor '{name}' appears in both '{self.entries[name].file}'"
                                      f" and '{f}'")
                self.entries[name] = info
        self.bytes_read = 0
        self._open: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def _slice(self, name: str):
        info = self.entries[name]
        if info.file not in self._open:
            self._open[info.file] = safe_open(str(info.file), framework="pt")
        return self._open[info.file].get_slice(name)  # type: ignore[attr-defined]

    def read_slice(self, name: str, start: int, stop: int, transposed: bool = False) -> Tensor:
        """Elements [start, stop) of the flattened tensor (of its transpose if `transposed`:
        the rows of the transpose are columns of the stored matrix)."""
        if name not in self.entries:
            raise WeightError(f"'{self.path}' has no tensor '{name}'")
        info = self.entries[name]
        shape = info.shape[::-1] if transposed else info.shape
        if not 0 <= start <= stop <= info.numel:
            raise WeightError(f"slice [{start}, {stop}) is outside '{name}' "
                              f"({info.numel} elements)")
        if len(shape) <= 1 or start == stop:
            rows = self._slice(name)[start:stop] if start < stop else torch.empty(0)
            self.bytes_read += (stop - start) * _ITEMSIZE[info.dtype]
            return rows.reshape(-1)
        row = info.numel // shape[0]
        r0, r1 = start // row, -(-stop // row)
        sl = self._slice(name)
        rows = sl[:, r0:r1].T if transposed else sl[r0:r1]
        self.bytes_read += (r1 - r0) * row * _ITEMSIZE[info.dtype]
        return rows.reshape(-1)[start - r0 * row:stop - r0 * row]

    def close(self) -> None:
        """Drop the open files: safetensors maps them, and mapped pages count in RSS."""
        self._open.clear()

    def read(self, name: str, transposed: bool = False) -> Tensor:
        info = self.entries[name]
        flat = self.read_slice(name, 0, info.numel, transposed)
        return flat.view(info.shape[::-1] if transposed else info.shape)


#: model parameter name -> candidate (stored name, transposed) pairs, best first
Candidates = Callable[[str], list[tuple[str, bool]]]


def bind(model: nn.Module, index: SafetensorsIndex, candidates: Candidates | None = None
         ) -> dict[str, tuple[str, bool]]:
    """canonical parameter name -> (stored name, transposed); one error listing every
    parameter that has no stored tensor or a wrongly shaped one. Works on a meta model."""
    candidates = candidates or (lambda n: [(n, False)])
    names: dict[int, list[str]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    whole = whole_shapes(model)  # expert parallelism: the file holds every expert
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        shapes[id(p)] = whole.get(id(p), tuple(p.shape))
    out: dict[str, tuple[str, bool]] = {}
    missing, wrong = [], []
    for pid, aliases in names.items():
        found = [(s, t) for a in aliases for s, t in candidates(a) if s in index]
        if not found:
            missing.append(aliases[0])
            continue
        stored, transposed = found[0]
        have = index.entries[stored].shape
        if (have[::-1] if transposed else have) != shapes[pid]:
            wrong.append(f"'{stored}' is {list(have)}{' (transposed)' if transposed else ''}, "
                         f"the model's '{aliases[0]}' is {list(shapes[pid])}")
            continue
        out[aliases[0]] = (stored, transposed)
    if missing or wrong:
        parts = []
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            parts.append(f"no tensor for {', '.join(missing[:8])}{more}")
        parts.extend(wrong[:3])
        if len(wrong) > 3:  # one line stays readable: the first few say what differs
            parts.append(f"{len(wrong) - 3} more tensors of other shapes")
        raise WeightError(f"weights '{index.path}' do not fit the model: " + "; ".join(parts) +
                          "; check that the weights were saved from this model configuration")
    return out


class Weights:
    """Pretrained weights bound to one model: read by the model's own parameter names."""

    def __init__(self, index: SafetensorsIndex, binding: dict[str, tuple[str, bool]]):
        self.index, self.binding = index, binding

    @property
    def bytes_read(self) -> int:
        return self.index.bytes_read

    def read_slice(self, param: str, start: int, stop: int) -> Tensor:
        """Elements [start, stop) of the flattened parameter `param` (canonical name, as
        `named_parameters()` yields it), in the stored dtype."""
        if param not in self.binding:
            raise WeightError(f"the model has no parameter '{param}' bound to '{self.index.path}'")
        stored, transposed = self.binding[param]
        return self.index.read_slice(stored, start, stop, transposed)

    def close(self) -> None:
        self.index.close()

    @torch.no_grad()
    def load_into(self, model: nn.Module) -> None:
        """Copy every parameter whole (one process holding the full model: stage 0, sample)."""
        for name, p in model.named_parameters():
            p.copy_(self.read_slice(name, 0, p.numel()).view(p.shape))
