"""A tensor not in memory yet: what a checkpoint save or load sees of a state that lives in
an offload tier (ZeRO-Infinity), brought in only while its bytes are written or read."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor


class Lazy:
    """Shape and dtype of a tensor, and `load()`: the tensor itself, in host memory, the
    caller's to drop after use (a checkpoint writes it and lets it go)."""

    def __init__(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
                 load: Callable[[], Tensor]):
        self.shape, self.dtype, self._load = torch.Size(shape), dtype, load

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def load(self) -> Tensor:
        t = self._load()
        assert t.shape == self.shape and t.dtype == self.dtype, (t.shape, self.shape)
        return t

    def view(self, *shape: Any) -> Lazy:
        """The same elements in another shape (a list, a tuple or the sizes)."""
        size = torch.Size(shape[0] if len(shape) == 1 and not isinstance(shape[0], int)
                          else shape)
        return Lazy(size, self.dtype, lambda: self.load().view(size))

    def flat(self, a: int, b: int) -> Lazy:
        """Elements [a, b) of the flattened tensor (itself when that is all of it, flat)."""
        if (a, b) == (0, self.numel()) and self.ndim == 1:
            return self
        return Lazy((b - a,), self.dtype, lambda: self.load().reshape(-1)[a:b])


def flat_slice(v: Tensor | Lazy, a: int, b: int) -> Tensor | Lazy:
    """v.reshape(-1)[a:b], for a tensor or a `Lazy` one."""
    return v.flat(a, b) if isinstance(v, Lazy) else v.reshape(-1)[a:b]


class LoadMeter:
    """Bytes of tier states a checkpoint has loaded and not yet let go: `live` now,
    `peak` the most at once, `total` all read — what a streamed save or load holds of
    an offloaded run's states beyond the run itself. Counts while installed with
    `with LoadMeter() as m:`."""

    active: ClassVar[list[LoadMeter]] = []

    def __init__(self) -> None:
        self.live = self.peak = self.total = 0

    def __enter__(self) -> LoadMeter:
        LoadMeter.active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        LoadMeter.active.remove(self)

    def loaded(self, t: Tensor) -> None:
        n = t.nbytes
        self.live += n
        self.total += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._freed, n)

    def _freed(self, n: int) -> None:
        self.live -= n


def from_tier(p: Any) -> Lazy:
    """A tensor that lives in an offload tier (`zero.tiers.placed.Placed`), read from it straight
    into fresh host memory when loaded; the tensor's own state (away, clean) is left as
    it is. The read is the checkpoint's: it is not counted in the step's tier bytes."""
    t = p.t

    def load() -> Tensor:
        p.settle()  # a write in flight lands first
        if p.resident or not p.moves:
            return p.ready()
        out = torch.empty(t.numel(), dtype=t.dtype)
        h = p.tier.load(p.region, out)
        getattr(h, "synchronize", lambda: None)()  # a copy on a side stream: on the host
        h.wait()
        c = p.tier.counter
        with c.lock:
            c.read -= out.nbytes
        out = out.view(t.shape)
        for meter in LoadMeter.active:
            meter.loaded(out)
        return out
    return Lazy(t.shape, t.dtype, load)


def swap_lazy(x: Any, lazy: dict[int, Lazy]) -> Any:
    """A nested state dict with each tensor whose id `lazy` holds replaced by its `Lazy`
    (the dicts are new, the other values the same objects)."""
    if not lazy:
        return x
    if isinstance(x, Tensor):
        return lazy.get(id(x), x)
    if isinstance(x, dict):
        return {k: swap_lazy(v, lazy) for k, v in x.items()}
    return x
