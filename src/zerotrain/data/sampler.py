"""Distributed sampling that makes world sizes interchangeable.

The token stream is cut into non-overlapping windows of `seq_len + 1` tokens. Each
epoch is a seeded permutation of the windows; optimizer step s consumes the next
`global_batch` windows of that sequence. Rank r, micro-step m takes a fixed slice of
the step's windows. So:
- every (rank, world size) sees a disjoint stream, reproducible from (seed, step);
- the *global* batch of a step is the same whatever the world size or accumulation,
  which is what lets ZeRO-k on N ranks be compared with one process;
- resuming at step s needs no sampler state: the batch is a function of s.
"""

from __future__ import annotations

import numpy as np
import torch

from zerotrain.data.corpus import DataError


class WindowSampler:
    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(
                f"data has {len(tokens)} tokens, fewer than one window of model.block_size+1 = "
                f"{seq_len + 1}; give more text or a smaller model.block_size"
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
            out[sel] = self._perm(int(epoch))[pos[sel] % self.n_windows]
        return out

    def windows(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        rows = np.stack([np.asarray(self.tokens[i * T: i * T + T + 1], dtype=np.int64)
                         for i in ids])
        t = torch.from_numpy(rows)
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


def eval_batches(tokens: np.ndarray, seq_len: int, rank: int, world: int, micro_bs: int,
                 n_batches: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed validation set (same windows every evaluation), split across ranks.

    Every rank gets the same number of batches: under ZeRO-3 each forward is a
    collective, so uneven counts would leave one rank waiting forever.
    """
    s = WindowSampler(tokens, seq_len, seed)
    total = min(s.n_windows, n_batches * micro_bs * world)
    total -= total % world
    if total == 0:
        raise DataError(f"the validation split has {s.n_windows} window(s) of "
                        f"model.block_size+1 = {seq_len + 1} tokens, fewer than the "
                        f"{world} ranks; raise data.val_fraction or give more data")
    ids = s.window_ids(0, total)
    mine = ids[rank::world]
    return [s.windows(mine[i:i + micro_bs]) for i in range(0, len(mine), micro_bs)]
