"""Hugging Face checkpoints whose on-disk names differ from the model's in-memory names.

transformers 5 keeps a MoE layer's experts fused in memory (`mlp.experts.gate_up_proj`,
shape [E, 2I, H]) but reads and writes them per expert on disk
(`mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1.weight`).
It says how in its own conversion rules (`get_model_conversion_mapping`): renamings, then
converters whose operations stack expert lists (`MergeModulelist`) and concatenate
projections (`Concatenate`). This module applies those rules, not a table of its own:

- loading: `ConvertedIndex` names each stored tensor by transformers' `rename_source_key`
  and describes a fused parameter as the ordered list of stored tensors whose flattened
  concatenation it is, so a ZeRO rank still reads only the slice it owns;
- export: `to_disk_layout` is transformers' `revert_weight_conversion` on a meta model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from zerotrain.models.weights import SafetensorsIndex, TensorInfo, WeightError


@dataclass(frozen=True)
class Fused:
    """A parameter stored as pieces: its flat elements are the pieces' flat elements in
    order (`starts[i]` is piece i's first element)."""

    pieces: tuple[str, ...]
    starts: tuple[int, ...]
    info: TensorInfo


def _op(op: Any) -> tuple[str, int]:
    return type(op).__name__, int(getattr(op, "dim", 0))


def _layout(
    ops: list[Any], lists: list[list[str]], index: SafetensorsIndex
) -> tuple[list[str], tuple[int, ...]]:
    """(stored names in flat order, shape) of a converter's target.

    Stacking along dim 0 (`MergeModulelist(0)`) concatenates flat pieces; concatenating
    along dim 0 does too; concatenating stacked lists along dim 1 interleaves them per
    stacked index (per expert: gate then up). Any other operation is refused by name."""
    kinds = [_op(o) for o in ops]
    shapes = [index.entries[lst[0]].shape for lst in lists]
    n = len(lists[0])
    if any(len(lst) != n for lst in lists):
        raise WeightError(f"expert lists of different lengths: {[len(x) for x in lists]}")
    if kinds == [("MergeModulelist", 0)] and len(lists) == 1:
        return lists[0], (n, *shapes[0])
    if kinds == [("MergeModulelist", 0), ("Concatenate", 1)]:
        rows = sum(s[0] for s in shapes)
        return [lst[e] for e in range(n) for lst in lists], (n, rows, *shapes[0][1:])
    if kinds in ([("MergeModulelist", 0), ("Concatenate", 0)], [("Concatenate", 0)]):
        stacked = kinds[0][0] == "MergeModulelist"
        names = [k for lst in lists for k in lst]
        if stacked:
            return names, (n * len(lists), *shapes[0])
        return names, (sum(index.entries[k].shape[0] for k in names), *shapes[0][1:])
    raise WeightError(
        f"transformers converts these tensors with {[k for k, _ in kinds]}, "
        "which the sliced reader does not implement (it reads stacked and "
        "concatenated expert lists)"
    )


class ConvertedIndex:
    """A safetensors index seen under the in-memory names transformers gives its tensors
    (the interface `bind` and `Weights` use: `entries`, `in`, `read_slice`)."""

    def __init__(self, raw: SafetensorsIndex, model: nn.Module):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            dot_natural_key,
            rename_source_key,
        )

        self.raw, self.path, self.metadata = raw, raw.path, raw.metadata
        transforms = get_model_conversion_mapping(model)
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        meta_sd = dict.fromkeys(model.state_dict(), True)
        prefix = getattr(model, "base_model_prefix", None)
        self.entries: dict[str, TensorInfo] = {}
        self.plain: dict[str, str] = {}  # in-memory name -> stored name
        groups: dict[str, dict[str, list[str]]] = {}
        for key in sorted(raw.entries, key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters, prefix, meta_sd)
            if pattern is None:
                self.plain[target] = key
                self.entries[target] = raw.entries[key]
            else:
                groups.setdefault(target, {}).setdefault(pattern, []).append(key)
        self.fused: dict[str, Fused] = {}
        for target, by_pattern in groups.items():
            conv = next(c for c in converters if any(p in c.source_patterns for p in by_pattern))
            lists = [by_pattern[p] for p in conv.source_patterns if p in by_pattern]
            names, shape = _layout(list(conv.operations), lists, raw)
            dtypes = {raw.entries[k].dtype for k in names}
            if len(dtypes) != 1:
                raise WeightError(f"the pieces of '{target}' have dtypes {sorted(dtypes)}")
            starts = [0]
            for k in names:
                starts.append(starts[-1] + raw.entries[k].numel)
            if starts[-1] != math.prod(shape):
                raise WeightError(f"the pieces of '{target}' do not fill its shape {shape}")
            info = TensorInfo(raw.entries[names[0]].file, shape, dtypes.pop())
            self.fused[target] = Fused(tuple(names), tuple(starts), info)
            self.entries[target] = info

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    @property
    def bytes_read(self) -> int:
        return self.raw.bytes_read

    def read_slice(self, name: str, start: int, stop: int, transposed: bool = False) -> Tensor:
        """Elements [start, stop) of the flattened in-memory tensor: a fused one is read
        from each stored piece the range covers, and only those rows."""
        if name in self.plain:
            return self.raw.read_slice(self.plain[name], start, stop, transposed)
        if name not in self.fused:
            raise WeightError(f"'{self.path}' has no tensor '{name}'")
        if transposed:
            raise WeightError(
                f"'{name}' is fused from several tensors; it cannot be read transposed"
            )
        f = self.fused[name]
        if not 0 <= start <= stop <= f.starts[-1]:
            raise WeightError(
                f"slice [{start}, {stop}) is outside '{name}' ({f.starts[-1]} elements)"
            )
        parts = []
        for piece, lo, hi in zip(f.pieces, f.starts, f.starts[1:], strict=False):
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                parts.append(self.raw.read_slice(piece, a - lo, b - lo))
        return torch.cat(parts) if parts else torch.empty(0)

    def read(self, name: str, transposed: bool = False) -> Tensor:
        info = self.entries[name]
        return self.read_slice(name, 0, info.numel, transposed).view(info.shape)

    def close(self) -> None:
        self.raw.close()


def to_disk_layout(model: nn.Module, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """The state dict under the names and shapes `from_pretrained` reads (transformers'
    own reversal of its load-time conversion; `model` may live on the meta device)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(state_dict))
