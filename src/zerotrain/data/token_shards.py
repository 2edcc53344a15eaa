"""The on-disk token formats, written and read here and nowhere else.

A token-shard folder (what `shards.prepare` / `zerotrain prepare SRC --out DIR` makes):

    manifest.json        {"format": "zerotrain-shards", "version": 1, "tokenizer",
                          "vocab_size", "dtype", "separator", "tokens", "shards":
                          [{"file", "tokens", "sha256"}, ...], ...what the writer adds}
    shard_00000.bin ...  the tokens, raw, in `dtype` (uint16 when the vocabulary fits
                         in 2^16, else uint32), in order; no header

`ShardWriter` appends tokens into fixed-size shards, hashing them; `write_manifest`
finishes a folder. `TokenShards` opens one, validates it against its manifest (and, on
request, the checksums), and reads windows with `os.pread`: bytes go through the page
cache but are never mapped into the process, so a long run that touches the whole
corpus keeps a flat RSS (`shard(i)` gives a read-only memmap when an array view is
wanted). Every problem is one `DataError` naming the shard or field and the fix.

The legacy byte file (`zerotrain prepare SRC --out FILE.bin`, byte tokenizer only): one
uint16 file of byte tokens (0-255) and a `FILE.json` sidecar; `write_byte_file` /
`read_byte_file` are the only code that knows it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from zerotrain.data.errors import DataError
from zerotrain.data.tokenizer import Tokenizer
from zerotrain.data.windows import SegmentWindows, SplitWindows, split_windows

MANIFEST = "manifest.json"
FORMAT = "zerotrain-shards"
VERSION = 1
BYTE_VOCAB = 256  # the legacy .bin holds byte tokens only
_MAX_OPEN = 64  # shard file descriptors kept open at once


def is_shard_folder(path: str | Path) -> bool:
    return (Path(path).expanduser() / MANIFEST).is_file()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# ----------------------------------------------------------------------------- writing


class ShardWriter:
    """Appends tokens to fixed-size shard files, hashing them on the way."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int):
        self.folder, self.dtype, self.cap = folder, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._file = None
        self._count = 0
        self._hash = hashlib.sha256()

    def add(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._file is None:
                name = f"shard_{len(self.shards):05d}.bin"
                self._file = open(self.folder / name, "wb")  # noqa: SIM115 (closed in _finish)
                self._name, self._count, self._hash = name, 0, hashlib.sha256()
            take = tokens[:self.cap - self._count]
            data = np.ascontiguousarray(take, dtype=self.dtype).tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += len(take)
            tokens = tokens[len(take):]
            if self._count == self.cap:
                self._finish()

    def _finish(self) -> None:
        assert self._file is not None
        self._file.close()
        self.shards.append({"file": self._name, "tokens": self._count,
                            "sha256": self._hash.hexdigest()})
        self._file = None

    def close(self) -> list[dict[str, Any]]:
        if self._file is not None:
            self._finish()
        return self.shards


def write_manifest(folder: Path, fields: dict[str, Any]) -> dict[str, Any]:
    """Finish a folder `ShardWriter` filled: its manifest, the format's own keys first."""
    manifest = {"format": FORMAT, "version": VERSION, **fields}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The manifest of a shard folder; one DataError when there is none or it is damaged."""
    folder = Path(folder).expanduser()
    path = folder / MANIFEST
    if not path.is_file():
        raise DataError(f"'{folder}' is not a token-shard folder (no {MANIFEST}); "
                        "create one with `zerotrain prepare SRC --out DIR`")
    try:
        m = json.loads(path.read_text())
    except ValueError as e:
        raise DataError(f"'{path}' is not valid JSON ({e}); prepare the folder again") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise DataError(f"'{path}' is not a zerotrain shard manifest")
    return m


# ----------------------------------------------------------------------------- reading


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
        self.manifest = read_manifest(self.folder)
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


# ----------------------------------------------------------------------------- legacy .bin


def is_byte_file(path: str | Path | None) -> bool:
    """Whether data.path names a legacy byte-token file (`prepare --out FILE.bin`)."""
    return path is not None and Path(path).suffix == ".bin"


def write_byte_file(tokens: np.ndarray, out: Path, source: str) -> dict[str, Any]:
    """`tokens` (byte tokens) as `out` (uint16, written whole, then renamed into place)
    and its `.json` sidecar; returns the sidecar."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".bin.tmp")
    np.asarray(tokens, dtype=np.uint16).tofile(tmp)
    tmp.replace(out)
    meta = {"tokens": len(tokens), "vocab_size": BYTE_VOCAB, "dtype": "uint16",
            "source": source}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    return meta


def read_byte_file(p: Path) -> np.ndarray:
    """A `.bin` of uint16 byte tokens, memory-mapped. Any other file named .bin (raw
    text, another tool's tokens) is refused before training: its values are checked
    against the 256 byte tokens unless the sidecar vouches for it."""
    size = p.stat().st_size
    fix = (f"a .bin must be uint16 byte tokens from `zerotrain prepare SRC --out {p.name}`; "
           "for a text file give it a text suffix (e.g. .txt), for another tokenizer's tokens "
           "prepare a shard folder")
    if size < 4 or size % 2:
        raise DataError(f"'{p}' is not a uint16 token file (size {size} bytes); {fix}")
    tokens = np.memmap(p, dtype=np.uint16, mode="r")
    try:
        meta = json.loads(p.with_suffix(".json").read_text())
        vouched = meta.get("tokens") == len(tokens) and meta.get("vocab_size") == BYTE_VOCAB
    except (OSError, ValueError, AttributeError):
        vouched = False
    if not vouched:
        for start in range(0, len(tokens), 1 << 24):  # a pass in 32 MiB pieces
            part = np.asarray(tokens[start:start + (1 << 24)])
            if part.max() >= BYTE_VOCAB:
                i = start + int(np.argmax(part >= BYTE_VOCAB))
                raise DataError(f"'{p}' holds {int(tokens[i])} at token {i}, not a byte "
                                f"token (0-255); {fix}")
    return tokens
