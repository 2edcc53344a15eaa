"""Distributed sampling that makes world sizes interchangeable.

The token stream is cut into non-overlapping windows of `seq_len + 1` tokens. Each
epoch is a seeded permutation of the windows; optimizer step s consumes the next
`global_batch` windows of that sequence. Rank r, micro-step m takes a fixed slice of
the step's windows. So:
- every (rank, world size) sees a disjoint stream, reproducible from (seed, step);
- the *global* batch of a step is the same whatever the world size or accumulation,
  which is what lets ZeRO-k on N ranks be compared with one process;
- resuming at step s needs no sampler state: the batch is a function of s.

`tokens` is an array (held in memory) or anything with a `windows(seq_len)` method
returning a window source (token shards read from disk, a train/validation view of them;
see `windows.py`). Up to 2^20 windows the epoch's permutation is numpy's, held in memory;
beyond that a stateless Feistel permutation computes each position's window on demand,
so a rank's memory does not grow with the corpus.
"""

from __future__ import annotations

import numpy as np
import torch

from zerotrain.data.errors import DataError
from zerotrain.data.windows import ArrayWindows, WindowSource, permutation

EXPLICIT_PERM_MAX = 1 << 20  # windows; above this the permutation is computed, not stored


def as_windows(tokens, seq_len: int) -> WindowSource:
    """The window source of an array or of an object that makes its own (`windows`)."""
    make = getattr(tokens, "windows", None)
    return make(seq_len) if callable(make) else ArrayWindows(tokens, seq_len)


class WindowSampler:
    def __init__(self, tokens, seq_len: int, seed: int, split: str = "training"):
        self.tokens = tokens
        self.source = as_windows(tokens, seq_len)
        self.seq_len = seq_len
        self.seed = seed
        self.n_windows = self.source.n
        if self.n_windows < 1:
            size = f"{len(tokens)} tokens" if hasattr(tokens, "__len__") else "too few tokens"
            fix = ("raise data.val_fraction, " if split == "validation"
                   else "lower data.val_fraction, ")
            raise DataError(
                f"the {split} split has {size}, fewer than one window of model.block_size+1 "
                f"= {seq_len + 1}; {fix}give more text or a smaller model.block_size"
            )
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.clear()
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(self.n_windows)
        return self._perms[epoch]

    def window_ids(self, start: int, count: int) -> np.ndarray:
        """Window ids at positions [start, start+count) of the endless epoch sequence."""
        pos = np.arange(start, start + count)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(pos // self.n_windows):
            sel = pos // self.n_windows == epoch
            local = pos[sel] % self.n_windows
            if self.n_windows <= EXPLICIT_PERM_MAX:
                out[sel] = self._perm(int(epoch))[local]
            else:
                out[sel] = permutation(local, self.n_windows, [self.seed, int(epoch)])
        return out

    def windows(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.from_numpy(self.source.get(np.asarray(ids)))
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def batch(self, step: int, micro: int, rank: int, world: int, micro_bs: int,
              accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of shape (micro_bs, seq_len) for one rank's micro-step."""
        global_bs = micro_bs * world * accum
        ids = self.window_ids(step * global_bs, global_bs)
        return self.windows(ids[local_rows(micro, rank, world, micro_bs)])


def local_rows(micro: int, rank: int, world: int, micro_bs: int) -> slice:
    """The rows of a step's global batch that `rank` takes at micro-step `micro`.

    Micro-step-major, then rank: the global batch is the same at any world size and
    accumulation, which is what makes N ranks comparable with one process.
    """
    start = (micro * world + rank) * micro_bs
    return slice(start, start + micro_bs)


def eval_batches(tokens, seq_len: int, rank: int, world: int, micro_bs: int,
                 n_batches: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed validation set (same windows every evaluation), split across ranks.

    Every rank gets the same number of batches: under ZeRO-3 each forward is a
    collective, so uneven counts would leave one rank waiting forever.
    """
    s = WindowSampler(tokens, seq_len, seed, split="validation")
    total = min(s.n_windows, n_batches * micro_bs * world)
    total -= total % world
    if total == 0:
        raise DataError(f"the validation split has {s.n_windows} window(s) of "
                        f"model.block_size+1 = {seq_len + 1} tokens, fewer than the "
                        f"{world} ranks; raise data.val_fraction or give more data")
    ids = s.window_ids(0, total)
    mine = ids[rank::world]
    return [s.windows(mine[i:i + micro_bs]) for i in range(0, len(mine), micro_bs)]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch onto its device. Off the CPU it goes through pinned memory without
    blocking the host: a copy from pageable memory would first wait for the device to
    drain its queue, so the host could never run a step ahead."""
    if device.type == "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
