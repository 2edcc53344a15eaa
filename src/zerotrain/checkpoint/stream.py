"""A safetensors file written tensor by tensor, hashed as it is written.

The bytes are exactly those `safetensors.torch.save_file` writes for the same tensors (a
test compares them): an 8-byte little-endian header length, the compact JSON header
(`__metadata__` first, then the tensors in file order), padded with spaces to a multiple
of 8 bytes, then each tensor's raw bytes. The file order is safetensors' own: by dtype,
widest kind first (its enum order, descending), then by name. (Several metadata keys
safetensors writes in its hash map's varying order: the same bytes for at most one;
checkpoints have none.)

A value may be a `Lazy` tensor (zero/tiers/lazy.py): it is loaded just before its bytes are
written and dropped right after, so a rank whose states live in an offload tier holds
about one tensor of them at a time, never the whole state.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from zerotrain.zero.tiers.lazy import Lazy

#: safetensors' dtype names, in the order its files sort them (first written first)
ORDER = ["U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E4M3",
         "F8_E5M2", "I8", "U8", "BOOL"]
NAMES = {torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.float32: "F32",
         torch.uint32: "U32", torch.int32: "I32", torch.bfloat16: "BF16",
         torch.float16: "F16", torch.uint16: "U16", torch.int16: "I16",
         torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int8: "I8",
         torch.uint8: "U8", torch.bool: "BOOL"}


def writable(tensors: Mapping[str, Tensor | Lazy]) -> bool:
    """Whether every dtype is one this writer orders like safetensors."""
    return all(v.dtype in NAMES for v in tensors.values())


def header(tensors: Mapping[str, Tensor | Lazy],
           metadata: dict[str, str] | None = None) -> tuple[bytes, list[str]]:
    """(the 8-byte length + padded JSON header, the keys in file order)."""
    keys = sorted(tensors, key=lambda k: (ORDER.index(NAMES[tensors[k].dtype]),
                                          k.encode()))
    head: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    at = 0
    for k in keys:
        v = tensors[k]
        n = v.numel() * v.element_size()
        head[k] = {"dtype": NAMES[v.dtype], "shape": list(v.shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, keys


def _bytes(t: Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def write(path: str | Path, tensors: Mapping[str, Tensor | Lazy],
          metadata: dict[str, str] | None = None) -> str:
    """Write `tensors` as one safetensors file, one tensor in memory at a time; returns
    the file's SHA-256 (hex), computed from the bytes as they are written."""
    head, keys = header(tensors, metadata)
    h = hashlib.sha256(head)
    with open(path, "wb") as f:
        f.write(head)
        for k in keys:
            v = tensors[k]
            t = v.load() if isinstance(v, Lazy) else v
            data = _bytes(t)
            f.write(data)
            h.update(data)
            del t, data  # a loaded state goes before the next one comes
    return h.hexdigest()
