"""The memory audit: the bytes a rank's units hold, per model state, read from the live
tensors (never recomputed: this is what the engine prints and tests hold against the
formulas of `memory/`, which never see a tensor).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import Tensor

CATEGORIES = ("params", "grads", "master", "optimizer")


def param_tensors(u: Any) -> list[Tensor]:
    """The parameter tensors of a unit: its full buffer, or (ZeRO-3) its shard and the
    full buffer while it has storage (a persistent unit's shard is a view of it)."""
    shard = getattr(u, "shard", None)
    if shard is None:
        return [u.params]
    return [shard] + ([u.params] if u.params.untyped_storage().nbytes() else [])


def tensors_by_category(units: Sequence[Any], grads_sharded: bool, offload: bool,
                        optimizer_state: Iterable[dict] = ()) -> list[tuple[str, str, Tensor]]:
    """(category, placement, tensor) for every persistent model-state tensor."""
    host = "host" if offload else "device"
    out: list[tuple[str, str, Tensor]] = [("params", "device", t) for u in units
                                           for t in param_tensors(u)]
    grads_place = host if grads_sharded else "device"
    out += [("grads", grads_place, u.grad) for u in units]
    out += [("master", host, u.master) for u in units]
    for st in optimizer_state:  # Kahan's compensation (bf16 masters) is the master's
        out += [("master" if k == "master_comp" else "optimizer", host, t)
                for k, t in st.items() if isinstance(t, Tensor) and t.dim() > 0]
    return out


def memory_breakdown(units: Sequence[Any], grads_sharded: bool, offload: bool,
                     optimizer_state: Iterable[dict] = ()) -> dict[str, dict[str, int]]:
    """Bytes held per category on device and host; shared storage counted once.

    `optimizer_state`: the optimizer's per-tensor state dicts (`optimizer.state.values()`).
    """
    out = {p: dict.fromkeys(CATEGORIES, 0) for p in ("device", "host")}
    seen: set[int] = set()
    for cat, place, t in tensors_by_category(units, grads_sharded, offload, optimizer_state):
        st = t.untyped_storage()
        if st.data_ptr() in seen or st.nbytes() == 0:
            continue
        seen.add(st.data_ptr())
        out[place][cat] += st.nbytes()
    return out
