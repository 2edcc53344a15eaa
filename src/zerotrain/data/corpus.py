"""Where byte tokens come from: the embedded corpus, user text, or a prepared .bin.

Tokens are bytes (vocab 256): no tokenizer to download, every machine can train. The
embedded default corpus is the running interpreter's own standard-library `.py`
sources — real text that is present wherever Python is.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from zerotrain.data.errors import DataError
from zerotrain.data.sources import inventory
from zerotrain.data.token_shards import is_byte_file, read_byte_file, write_byte_file

__all__ = ["DataError", "decode", "encode", "load_tokens", "prepare", "stdlib_sources",
           "train_val_split"]

VOCAB_SIZE = 256
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_BLOCK = 1 << 16  # train/val are interleaved in 64 KiB blocks so both see every file type


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def decode(tokens) -> str:
    return bytes(int(t) & 0xFF for t in tokens).decode("utf-8", errors="replace")


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        f for f in root.rglob("*.py")
        if not _SKIP_DIRS.intersection(f.relative_to(root).parts)
    ]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def _read_texts(files: list[Path], label: str) -> np.ndarray:
    parts = []
    for f in files:
        try:
            parts.append(f.read_bytes())
        except OSError as e:
            raise DataError(f"cannot read '{f}' ({e.strerror}); check permissions or remove it "
                            f"from {label}") from None
    blob = b"\n\n".join(p for p in parts if p)
    if not blob:
        raise DataError(f"{label} holds no text; give a non-empty text file or folder")
    return np.frombuffer(blob, dtype=np.uint8).astype(np.uint16)


def load_tokens(path: str | Path | None) -> np.ndarray:
    """The whole token stream as uint16 (a read-only memmap for .bin files)."""
    if path is None:
        return _read_texts(stdlib_sources(), "the embedded standard-library corpus")
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data.path '{p}' does not exist; pass a text file, a folder of text "
                        "files, or a .bin written by `zerotrain prepare`")
    if p.is_dir():
        if not any(f.is_file() for f in p.rglob("*")):
            raise DataError(f"data.path folder '{p}' contains no files")
        # text files only: no dot-directories (.git), binaries (images) or .json/.bin outputs
        files = [f for kind, f in inventory([p]).files if kind != "parquet"]
        return _read_texts(files, f"folder '{p}'")
    if is_byte_file(p):
        return read_byte_file(p)
    return _read_texts([p], f"file '{p}'")


def prepare(src: str | Path | None, out: str | Path) -> dict:
    """Tokenise once into the legacy byte-token file (`.bin`, see `token_shards`)."""
    out = Path(out)
    if out.suffix != ".bin":
        raise DataError(f"output '{out}' must end in .bin")
    return write_byte_file(load_tokens(src), out, str(src) if src else "stdlib")


def train_val_split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic split: every k-th 64 KiB block is validation (k = round(1/fraction))."""
    n_blocks = -(-len(tokens) // _BLOCK)
    every = max(2, round(1 / val_fraction))
    if n_blocks < every:  # small data: last fraction of the stream
        cut = int(len(tokens) * (1 - val_fraction))
        return np.asarray(tokens[:cut]), np.asarray(tokens[cut:])
    train, val = [], []
    for b in range(n_blocks):
        chunk = tokens[b * _BLOCK:(b + 1) * _BLOCK]
        (val if b % every == every - 1 else train).append(np.asarray(chunk))
    return np.concatenate(train), np.concatenate(val)
