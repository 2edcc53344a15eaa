"""A script's `client_state` in a checkpoint's JSON manifest, tensors included.

DeepSpeed pickles `client_state`, so scripts keep tensors (an EMA, a generator's state),
numpy arrays (numpy's RNG state), tuples and int-keyed dicts there. zerotrain's
checkpoints hold no pickle (nothing in them runs code when read), so those values are
written as tagged JSON objects — `{"__zerotrain__": "tensor", "dtype", "shape", "data"}`
with the raw bytes in base64 — and rebuilt on load: the same values and types come back
(tensors on the CPU, as read from disk). Anything else JSON cannot hold is refused when
saving, by its place in the structure.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np
import torch

from zerotrain.checkpoint.io import CheckpointError

TAG = "__zerotrain__"
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


def encode(value: Any, where: str = "client_state") -> Any:
    """`value` as plain JSON; tensors, numpy arrays, tuples and dicts with keys other
    than strings become tagged objects. A value of another type is a CheckpointError."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {TAG: "float", "value": repr(value)}
    if isinstance(value, torch.Tensor):
        return _tensor(value, where)
    if isinstance(value, np.ndarray | np.generic):
        return {
            TAG: "ndarray",
            "value": _tensor(torch.from_numpy(np.asarray(value).copy()), where),
            "scalar": np.ndim(value) == 0,
        }
    if isinstance(value, list | tuple):
        items = [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else {TAG: "tuple", "items": items}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {
            TAG: "dict",
            "items": [
                [encode(k, f"{where} key {k!r}"), encode(v, f"{where}[{k!r}]")]
                for k, v in value.items()
            ],
        }
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a zerotrain "
        "checkpoint cannot hold (it holds no pickles): keep numbers, strings, lists, dicts, "
        "tuples, tensors and numpy arrays in client_state"
    )


def decode(value: Any) -> Any:
    """The inverse of `encode`."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(TAG)
    if kind is None:
        return {k: decode(v) for k, v in value.items()}
    if kind == "tensor":
        dtype = _DTYPES.get(value["dtype"])
        if dtype is None:
            raise CheckpointError(f"client_state holds a tensor of unknown dtype {value['dtype']}")
        raw = bytearray(base64.b64decode(value["data"]))
        flat = (
            torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
        return flat.view(dtype).reshape(value["shape"])
    if kind == "ndarray":
        out = decode(value["value"]).numpy()
        return out[()] if value.get("scalar") else out
    if kind == "tuple":
        return tuple(decode(v) for v in value["items"])
    if kind == "dict":
        return {_key(decode(k)): decode(v) for k, v in value["items"]}
    if kind == "float":
        return float(value["value"])
    raise CheckpointError(
        f"client_state holds an object tagged {kind!r}, which this version "
        "of zerotrain does not know"
    )


def _key(k: Any) -> Any:
    return tuple(_key(x) for x in k) if isinstance(k, list) else k


def _tensor(t: torch.Tensor, where: str) -> dict[str, Any]:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise CheckpointError(
            f"{where} is a tensor of dtype {t.dtype}, which a zerotrain checkpoint cannot hold"
        )
    if t.is_sparse or t.layout != torch.strided:
        t = t.to_dense()
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {
        TAG: "tensor",
        "dtype": name,
        "shape": list(t.shape),
        "data": base64.b64encode(raw).decode("ascii"),
    }
