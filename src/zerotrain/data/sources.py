"""Where text comes from, cut into pieces small enough that nothing holds a whole corpus.

Inputs: text files, folders of them (dot-directories, dotfiles and binary files are
skipped: a folder may hold `.git/` or images), `.jsonl` (one document per line, in a
text field) and `.parquet` (one document per row; needs pyarrow). Each input is cut into
`Item`s of about `chunk_bytes`: byte ranges of a file cut at line breaks (found by
reading a little around each cut; see `cut_point` for why a BPE sees the same tokens as
with the whole file), or one row group of a parquet file. An item is read
on its own, so a pool of processes can tokenize items in any order and the writer puts
them back in order. A text file is one document; its last item ends the document.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from zerotrain.data.errors import DataError

BINARY_SUFFIXES = {
    ".png", ".jpg", ".jpeg", ".gif", ".bmp", ".ico", ".webp", ".pdf", ".zip", ".gz", ".bz2",
    ".xz", ".zst", ".tar", ".7z", ".pyc", ".pyo", ".so", ".dll", ".dylib", ".o", ".a", ".exe",
    ".bin", ".npy", ".npz", ".pt", ".pth", ".safetensors", ".ckpt", ".woff", ".woff2", ".ttf",
    ".mp3", ".mp4", ".wav", ".db", ".sqlite",
}
SKIP_DIRS = {"__pycache__", "node_modules"}
_SNIFF = 8192
_MAX_LINE = 1 << 20  # a text line longer than this may be cut (not a jsonl record)


@dataclass(frozen=True)
class Item:
    kind: str          # "text" | "jsonl" | "parquet"
    path: str
    start: int = 0     # byte range (text, jsonl) or row group (parquet: start = index)
    end: int = 0
    ends_doc: bool = True  # text: this piece ends its file's document


@dataclass
class Inventory:
    files: list[tuple[str, Path]] = field(default_factory=list)  # (kind, path)
    skipped: list[str] = field(default_factory=list)

    def summary(self, inputs: Sequence[str]) -> dict:
        kinds: dict[str, int] = {}
        for k, _ in self.files:
            kinds[k] = kinds.get(k, 0) + 1
        return {"inputs": list(inputs), "files": kinds, "skipped": len(self.skipped),
                "skipped_examples": self.skipped[:10]}


def is_binary(path: Path) -> bool:
    """Git's rule: a NUL byte in the first 8 KiB, or a suffix that is never text."""
    if path.suffix.lower() in BINARY_SUFFIXES:
        return True
    with open(path, "rb") as f:
        return b"\0" in f.read(_SNIFF)


def _kind(path: Path) -> str:
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(path.suffix.lower(), "text")


def _walk(folder: Path) -> Iterator[Path]:
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        for name in sorted(files):
            if not name.startswith("."):
                yield Path(root) / name


def inventory(sources: Sequence[str | Path]) -> Inventory:
    """Every input file, in a deterministic order, with what was skipped and why."""
    inv = Inventory()
    for src in sources:
        p = Path(src).expanduser()
        if not p.exists():
            raise DataError(f"input '{p}' does not exist; give text files, folders, .jsonl "
                            "or .parquet files")
        candidates = [p] if p.is_file() else list(_walk(p))
        for f in candidates:
            kind = _kind(f)
            if p.is_dir() and f.suffix == ".json":  # manifests, configs: not corpus text
                inv.skipped.append(f"{f} (json)")
            elif kind == "text" and is_binary(f):
                inv.skipped.append(f"{f} (binary)")
            else:
                inv.files.append((kind, f))
    if not inv.files:
        raise DataError(f"no text found in {', '.join(map(str, sources))} "
                        f"({len(inv.skipped)} binary or skipped files)")
    return inv


def cut_point(buf: bytes, start: int, records: bool) -> int:
    """Where to cut `buf` at or after `start`, or -1. Records (jsonl): just after a newline.
    Text: just before a newline that follows a printable ASCII character. No byte-level
    BPE pre-token spans such a point (a pre-token never holds a non-space followed by a
    space), so tokenizing the pieces gives exactly the tokens of the whole text."""
    i = buf.find(b"\n", max(start, 1))
    while i >= 0 and not records and not 0x21 <= buf[i - 1] <= 0x7E:
        i = buf.find(b"\n", i + 1)
    return i + 1 if i >= 0 and records else i


def _next_cut(f, pos: int, size: int, records: bool) -> int:
    """The first cut point at or after `pos`, reading forward in 64 KiB steps. Text with
    no cut point within _MAX_LINE bytes is cut at a UTF-8 character start instead."""
    at = pos - 1  # one byte of context: the rule looks at the byte before the newline
    while at + 1 < size:
        f.seek(at)
        block = f.read((1 << 16) + 1)
        i = cut_point(block, 1, records)
        if i >= 0:
            return at + i
        at += len(block) - 1
        if not records and at - pos >= _MAX_LINE:
            f.seek(pos)
            head = f.read(4)
            return pos + next((j for j in range(len(head)) if head[j] & 0xC0 != 0x80), 0)
    return size


def split_text(text: str, piece: int = 1 << 16) -> list[str]:
    """`text` in pieces of about `piece` characters, cut by `cut_point`'s text rule (a
    tokenizer's memory grows with the length it encodes at once)."""
    out, start = [], 0
    while len(text) - start > piece:
        i = start + piece
        while True:
            i = text.find("\n", i)
            if i < 0 or "!" <= text[i - 1] <= "~":
                break
            i += 1
        if i < 0:
            break
        out.append(text[start:i])
        start = i
    out.append(text[start:])
    return out


def plan_items(inv: Inventory, chunk_bytes: int = 1 << 20) -> list[Item]:
    """Cut every input into items of about `chunk_bytes` at `cut_point`s."""
    items: list[Item] = []
    for kind, path in inv.files:
        if kind == "parquet":
            pf = _parquet().ParquetFile(path)
            items.extend(Item(kind, str(path), g, g + 1) for g in range(pf.num_row_groups))
            continue
        size = path.stat().st_size
        if size == 0:
            continue
        cuts = [0]
        with open(path, "rb") as f:
            while cuts[-1] + chunk_bytes < size:
                cuts.append(_next_cut(f, cuts[-1] + chunk_bytes, size, kind == "jsonl"))
        if cuts[-1] < size:
            cuts.append(size)
        for a, b in itertools.pairwise(cuts):
            items.append(Item(kind, str(path), a, b, ends_doc=kind != "text" or b == size))
    return items


def _parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(".parquet inputs need pyarrow; install it with `pip install pyarrow`, "
                        "or convert the data to .jsonl") from None
    return pq


def read_item(item: Item, text_field: str = "text") -> list[str | bytes]:
    """The documents (or, for text files, one piece of the file's document) of an item.
    Text pieces stay bytes so the byte tokenizer sees the file exactly."""
    if item.kind == "parquet":
        table = _parquet().ParquetFile(item.path).read_row_group(item.start)
        if text_field not in table.column_names:
            raise DataError(f"'{item.path}' has no column '{text_field}' (columns: "
                            f"{', '.join(table.column_names)}); set the text field")
        return [t for t in table.column(text_field).to_pylist() if t]
    with open(item.path, "rb") as f:
        f.seek(item.start)
        data = f.read(item.end - item.start)
    if item.kind == "text":
        return [data]
    docs: list[str | bytes] = []
    for n, line in enumerate(data.splitlines()):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)[text_field]
        except (ValueError, KeyError, TypeError):
            raise DataError(f"'{item.path}' (byte {item.start}, line {n + 1} of its chunk) is "
                            f"not a JSON object with a '{text_field}' field; fix the line or "
                            "set the text field") from None
        if doc:
            docs.append(str(doc))
    return docs


def iter_texts(sources: Sequence[str | Path], text_field: str = "text",
               chunk_bytes: int = 1 << 20) -> Iterator[str]:
    """Every document piece as text, in order, one item in memory at a time (BPE training)."""
    for item in plan_items(inventory(sources), chunk_bytes):
        for d in read_item(item, text_field):
            yield d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d
