"""Reading token shards written by `shards.prepare` (see that module for the layout)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from zerotrain.data.errors import DataError
from zerotrain.data.shards import FORMAT, MANIFEST
from zerotrain.data.tokenizer import Tokenizer
from zerotrain.data.windows import SegmentWindows, SplitWindows, split_windows

_MAX_OPEN = 64  # shard file descriptors kept open at once


def is_shard_folder(path: str | Path) -> bool:
    return (Path(path).expanduser() / MANIFEST).is_file()


class TokenShards:
    """One token stream over the shards of a prepared folder, read on demand.

    Validated at open: the manifest, every shard's presence and size, the tokenizer's
    vocabulary (and file checksum) when a tokenizer is given, and with `verify=True` every
    shard's SHA-256. Each problem is one `DataError` naming the shard or field.
    """

    def __init__(self, folder: str | Path, tokenizer: Tokenizer | None = None,
                 verify: bool = False):
        self._fds: dict[int, int] = {}
        self.folder = Path(folder).expanduser()
        self.manifest = self._read_manifest()
        self.dtype = np.dtype(self.manifest["dtype"])
        self.lengths = [int(s["tokens"]) for s in self.manifest["shards"]]
        self.paths = [self.folder / s["file"] for s in self.manifest["shards"]]
        for path, n in zip(self.paths, self.lengths):
            if not path.is_file():
                raise DataError(f"shard '{path}' listed in {MANIFEST} is missing; copy the "
                                "whole folder or prepare it again")
            if path.stat().st_size != n * self.dtype.itemsize:
                raise DataError(f"shard '{path}' holds {path.stat().st_size} bytes, the manifest "
                                f"says {n} {self.dtype.name} tokens; prepare the folder again")
        if verify:
            self.verify()
        if tokenizer is not None:
            self.check_tokenizer(tokenizer)

    def _read_manifest(self) -> dict[str, Any]:
        path = self.folder / MANIFEST
        if not path.is_file():
            raise DataError(f"'{self.folder}' is not a token-shard folder (no {MANIFEST}); "
                            "create one with `zerotrain prepare SRC --out DIR`")
        try:
            m = json.loads(path.read_text())
        except ValueError as e:
            raise DataError(f"'{path}' is not valid JSON ({e}); prepare the folder again") from None
        if m.get("format") != FORMAT:
            raise DataError(f"'{path}' is not a zerotrain shard manifest")
        return m

    def verify(self) -> None:
        """Hash every shard against the manifest (reads the whole corpus once)."""
        for path, meta in zip(self.paths, self.manifest["shards"]):
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda f=f: f.read(1 << 22), b""):
                    h.update(block)
            if h.hexdigest() != meta["sha256"]:
                raise DataError(f"shard '{path}' does not match its checksum in {MANIFEST} "
                                "(corrupted or replaced); prepare the folder again")

    def check_tokenizer(self, tok: Tokenizer) -> None:
        mine = self.manifest["tokenizer"]
        theirs = tok.describe()
        same_file = mine.get("sha256") is None or theirs.get("sha256") in (None, mine["sha256"])
        if self.manifest["vocab_size"] != tok.vocab_size or not same_file:
            raise DataError(
                f"shards '{self.folder}' were tokenized with {mine['name']} (vocab "
                f"{self.manifest['vocab_size']}) but the tokenizer is {theirs['name']} (vocab "
                f"{tok.vocab_size}{', another file' if not same_file else ''}); use the "
                f"tokenizer '{mine['spec']}' or prepare the data again with this one")

    def __len__(self) -> int:
        return sum(self.lengths)

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    def read(self, shard: int, start: int, count: int) -> np.ndarray:
        """`count` tokens of one shard from `start`, read with pread (nothing mapped)."""
        fd = self._fds.get(shard)
        if fd is None:
            if len(self._fds) >= _MAX_OPEN:
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = self._fds[shard] = os.open(self.paths[shard], os.O_RDONLY)
        size = self.dtype.itemsize
        data = os.pread(fd, count * size, start * size)
        return np.frombuffer(data, dtype=self.dtype)

    def shard(self, i: int) -> np.ndarray:
        return np.memmap(self.paths[i], dtype=self.dtype, mode="r")

    def windows(self, seq_len: int) -> SegmentWindows:
        return SegmentWindows(self.lengths, self.read, seq_len)

    def split(self, val_fraction: float) -> tuple[ShardSplit, ShardSplit]:
        """(train, validation): every round(1/val_fraction)-th block of 64 Ki tokens' worth
        of windows is validation; nothing is read or loaded."""
        return ShardSplit(self, val_fraction, False), ShardSplit(self, val_fraction, True)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        self.close()


class ShardSplit:
    """The train or validation part of a `TokenShards`; the sampler asks it for windows."""

    def __init__(self, shards: TokenShards, val_fraction: float, val: bool):
        self.shards, self.val_fraction, self.val = shards, val_fraction, val

    def windows(self, seq_len: int) -> SplitWindows:
        parts = split_windows(self.shards.windows(seq_len), self.val_fraction, seq_len)
        return parts[1] if self.val else parts[0]
