"""One tensor that lives in a tier between uses: `fetch` refills its storage in place (so
views of it — optimizer parameters, saved tensors — stay valid), `evict` writes it back
when it changed and releases the storage once the write has landed. The tiers
(zero/tiers/tier.py) move regions; this is what a home or a store holds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zerotrain.memory.host import host_buffer
from zerotrain.zero.tiers.io import IOHandle
from zerotrain.zero.tiers.tier import Tier


class Placed:
    """One tensor that lives in a tier between uses. It must own its storage from byte 0
    (views of it stay valid across moves: the storage is resized in place).

    fetch() starts bringing it back, ready() waits for it; evict() writes it back when it
    changed (`dirty`) and settle() releases the storage once the write has landed. A
    logical tier (`moves` False) keeps it resident and every call is free.
    """

    def __init__(self, tier: Tier, key: str, t: Tensor):
        assert t.storage_offset() == 0 and t.is_contiguous(), key
        st = t.untyped_storage()
        assert st.nbytes() == t.numel() * t.element_size() and st.resizable(), key
        self.tier, self.key, self.t = tier, key, t
        self.region = tier.region(key, t.numel(), t.dtype) if tier.moves else None
        self.resident, self.dirty = True, True
        self.loading: IOHandle | None = None
        self.storing: IOHandle | None = None
        self._staged: Tensor | None = None  # NVMe from a GPU: the pinned host copy in use
        self._pin, self._h2d = None, None  # its buffer; the event after a copy out of it
        self.last_load: IOHandle | None = None  # the latest fetch (timelines)

    @property
    def moves(self) -> bool:
        return self.region is not None

    def _host_side(self) -> bool:  # NVMe reads and writes host memory only
        return self.tier.kind == "nvme" and self.t.device.type != "cpu"

    def fetch(self) -> None:
        """Start the load if the tensor is away (a pending eviction is cancelled)."""
        if not self.moves or self.loading is not None:
            return
        if self.storing is not None:  # evicted but not released: still here, and clean
            self.storing.wait()
            self.storing, self._staged = None, None
            return
        if self.resident:
            return
        st = self.t.untyped_storage()
        st.resize_(self.t.numel() * self.t.element_size())
        dst = self._staged = self._staging() if self._host_side() else None
        assert self.region is not None
        self.loading = self.last_load = self.tier.load(self.region, self.t if dst is None else dst)
        self.resident, self.dirty = True, False

    def ready(self) -> Tensor:
        """The tensor, usable (fetching it now if nobody did)."""
        if not self.resident:
            self.fetch()
        if self.loading is not None:
            self.loading.wait()
            self.loading = None
            if self._staged is not None:
                self.t.copy_(self._staged, non_blocking=True)
                self._h2d = torch.cuda.Event()
                self._h2d.record(torch.cuda.current_stream(self.t.device))
                self._staged = None
        return self.t

    def _staging(self) -> Tensor:
        """The pinned buffer NVMe moves of a device tensor go through: exact size, made
        once (L-1), free when the latest copy out of it has run."""
        if self._pin is None:
            self._pin = host_buffer(self.t.numel(), self.t.dtype, True)
        if self._h2d is not None:
            self._h2d.synchronize()
            self._h2d = None
        return self._pin

    def evict(self) -> None:
        """Start moving it back to the tier (written only when `dirty`)."""
        if not self.moves or not self.resident or self.storing is not None:
            return
        self.ready()
        if not self.dirty:
            self._release()
            return
        src = self.t
        if self._host_side():  # one copy, straight into the pinned buffer
            src = self._staged = self._staging()
            src.copy_(self.t.reshape(-1))
        assert self.region is not None
        self.storing = self.tier.store(self.region, src)
        self.dirty = False

    def settle(self) -> None:
        """Wait for an eviction's write and release the storage; a side-stream copy is
        waited by the compute stream only, whose pool the storage returns to (S-3)."""
        if self.storing is not None:
            h, self.storing, self._staged = self.storing, None, None
            h.wait()
            self._release()

    def claim(self) -> Tensor:
        """Memory for a tensor about to be written whole: no read (a pending write
        lands first)."""
        if self.moves and not self.resident:
            self.t.untyped_storage().resize_(self.t.numel() * self.t.element_size())
            self.resident = True
        self.settle_write()
        self.dirty = True
        return self.t

    def drop(self) -> None:
        """Release without writing: the values are not needed again (a used gradient)."""
        if self.moves and self.resident:
            self.ready()
            self.settle_write()
            self._release()

    def settle_write(self) -> None:
        if self.storing is not None:
            h, self.storing, self._staged = self.storing, None, None
            h.wait()

    def _release(self) -> None:
        self.t.untyped_storage().resize_(0)
        self.resident = False
