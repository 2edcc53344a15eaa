"""Training windows over token streams that need not be in memory.

A window source answers two questions: how many windows of `seq_len + 1` tokens there are
(`n`), and what windows `ids` hold (`get`). Window i of a stream starts at token
i * seq_len, so consecutive windows share one token (the last target of one is the first
input of the next) and never overlap otherwise.
- `ArrayWindows`: one in-memory array (today's corpora; the layout the sampler always had).
- `SegmentWindows`: several segments (token shards) read on demand; a window never
  straddles two segments (the last < seq_len + 1 tokens of a segment are not used).
- `SplitWindows`: a train or validation view of another source, by blocks of windows
  (every k-th block is validation), computed by arithmetic: no index array, nothing read.
`permutation` is the stateless shuffle the sampler uses for large sources.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np


class WindowSource(Protocol):
    n: int

    def get(self, ids: np.ndarray) -> np.ndarray:
        """(len(ids), seq_len + 1) int64 tokens."""
        ...


class ArrayWindows:
    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.n = max(0, (len(tokens) - 1) // seq_len)

    def get(self, ids: np.ndarray) -> np.ndarray:
        T = self.seq_len
        return np.stack([np.asarray(self.tokens[i * T:i * T + T + 1], dtype=np.int64)
                         for i in ids]) if len(ids) else np.zeros((0, T + 1), np.int64)


class SegmentWindows:
    """`read(segment, start, count)` returns tokens of one segment (e.g. a pread of a shard)."""

    def __init__(self, lengths: Sequence[int], read: Callable[[int, int, int], np.ndarray],
                 seq_len: int):
        self.read, self.seq_len = read, seq_len
        per = np.array([max(0, (int(n) - 1) // seq_len) for n in lengths], dtype=np.int64)
        self.first = np.concatenate([[0], np.cumsum(per)])  # window id where each segment starts
        self.n = int(self.first[-1])

    def get(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        seg = np.searchsorted(self.first, ids, side="right") - 1
        out = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        for row, (s, i) in enumerate(zip(seg, ids)):
            out[row] = self.read(int(s), int(i - self.first[s]) * self.seq_len, self.seq_len + 1)
        return out


class SplitWindows:
    """Windows of `base` in groups of `every` blocks of `block` windows: the first every-1
    blocks of each group are training, the last validation."""

    def __init__(self, base: WindowSource, every: int, block: int, val: bool):
        self.base, self.every, self.block, self.val = base, every, block, val
        group = every * block
        full, rest = divmod(base.n, group)
        train_per = (every - 1) * block
        self.n = (full * block + max(0, rest - train_per)) if val else \
            (full * train_per + min(rest, train_per))

    def base_ids(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        group, B = self.every * self.block, self.block
        if self.val:
            return ids // B * group + (self.every - 1) * B + ids % B
        per = (self.every - 1) * B
        return ids // per * group + ids % per

    def get(self, ids: np.ndarray) -> np.ndarray:
        return self.base.get(self.base_ids(ids))


def split_windows(base: WindowSource, val_fraction: float, seq_len: int,
                  block_tokens: int = 1 << 16) -> tuple[SplitWindows, SplitWindows]:
    """(train, validation) views: every round(1/val_fraction)-th block of ~block_tokens
    tokens is validation, so both halves see every part of the corpus."""
    every = max(2, round(1 / val_fraction))
    block = max(1, min(block_tokens // seq_len, base.n // (every * 4) or 1))
    return (SplitWindows(base, every, block, val=False),
            SplitWindows(base, every, block, val=True))


# ----------------------------------------------------------------------------- shuffling

_M1, _M2, _G = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), \
    np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finaliser: a cheap, well-mixed hash of 64-bit words."""
    z = (x + key) * _G
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def permutation(pos: np.ndarray, n: int, seed: Sequence[int], rounds: int = 4) -> np.ndarray:
    """Image of positions `pos` under a seeded bijection of [0, n), in O(len(pos)) memory.

    A Feistel network permutes the 2h-bit integers (2^2h < 4n) whatever its round
    function; "cycle walking" (apply it again while the result is >= n) restricts that to
    [0, n), still a bijection. Seeded by `seed` (e.g. [seed, epoch]) through numpy's
    generator, so it is reproducible everywhere.
    """
    half = (max(2, (n - 1).bit_length()) + 1) // 2
    mask = np.uint64((1 << half) - 1)
    keys = np.random.default_rng(list(seed)).integers(
        0, 2**63, size=rounds, dtype=np.uint64)

    def once(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right, k) & mask)
        return (left << np.uint64(half)) | right

    with np.errstate(over="ignore"):
        x = once(np.asarray(pos, dtype=np.uint64))
        todo = np.nonzero(x >= n)[0]
        while len(todo):
            x[todo] = once(x[todo])
            todo = todo[x[todo] >= n]
    return x.astype(np.int64)
