"""Token shards: a corpus tokenized once, in bounded memory (the format itself, and its
reader, are `token_shards.py`'s).

`prepare` streams inputs (see `sources.py`) through a pool of tokenizing processes, in
items of about a MiB, and writes the tokens in input order through `ShardWriter`,
documents separated by the tokenizer's end-of-text token (the byte tokenizer has none: a
blank line). At most `2 × workers` items are in flight, so memory does not depend on the
corpus. Everything is written into `<out>.tmp` and renamed at the end, with a manifest:
tokenizer, vocabulary, dtype, per-shard token counts and SHA-256, and a summary of the
sources.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zerotrain.data.errors import DataError
from zerotrain.data.sources import Item, inventory, plan_items, read_item, split_text
from zerotrain.data.token_shards import ShardWriter, token_dtype, write_manifest
from zerotrain.data.tokenizer import Tokenizer, load_tokenizer

BYTE_SEPARATOR = b"\n\n"


def separator(tok: Tokenizer) -> list[int]:
    """Tokens between documents: end-of-text, or a blank line for tokenizers without one."""
    return [tok.eos_id] if tok.eos_id is not None else tok.encode(BYTE_SEPARATOR.decode())


# ----------------------------------------------------------------------------- tokenizing

_WORKER: dict[str, Any] = {}


def _init_worker(tok: Tokenizer | str, text_field: str) -> None:
    """Load the tokenizer once per process (a worker gets its spec, not the object)."""
    if isinstance(tok, str):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the pool is the parallelism
        tok = load_tokenizer(tok)
    _WORKER.update(tok=tok, field=text_field, sep=np.array(separator(tok), dtype=np.int64),
                   dtype=token_dtype(tok.vocab_size))


def _encode(tok: Any, docs: list[str | bytes]) -> list[np.ndarray]:
    if hasattr(tok, "encode_bytes") and all(isinstance(d, bytes) for d in docs):
        return [tok.encode_bytes(d) for d in docs]  # bytes: no decode/encode round trip
    out = []
    for d in docs:
        text = d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d
        # ~64 Ki characters at a time: encoding a MiB at once costs a tokenizer ~100 MB
        out.append(np.concatenate([np.asarray(tok.encode(p), dtype=np.int64)
                                   for p in split_text(text)]))
    return out


def tokenize_item(item: Item) -> tuple[np.ndarray, int, int]:
    """(tokens, UTF-8 bytes of text, documents ended) of one item, in the worker."""
    tok, sep = _WORKER["tok"], _WORKER["sep"]
    docs = read_item(item, _WORKER["field"])
    parts, ended = [], 0
    for arr in _encode(tok, docs):
        parts.append(arr)
        if item.kind != "text" or item.ends_doc:
            parts.append(sep)
            ended += 1
    nbytes = sum(len(d) if isinstance(d, bytes) else len(d.encode("utf-8")) for d in docs)
    out = np.concatenate(parts).astype(_WORKER["dtype"]) if parts else \
        np.zeros(0, _WORKER["dtype"])
    return out, nbytes, ended


def tokenize_items(items: Sequence[Item], tok: Tokenizer, text_field: str, workers: int
                   ) -> Iterator[tuple[np.ndarray, int, int]]:
    """tokenize_item over items, results in input order, at most 2 × workers in flight.
    Workers load the tokenizer from its spec (`describe()["spec"]`)."""
    if workers <= 0:
        _init_worker(tok, text_field)
        yield from map(tokenize_item, items)
        return
    ctx = mp.get_context("spawn")  # no forked copies of a parent's threads or tensors
    spec = tok.describe()["spec"]
    with ctx.Pool(workers, _init_worker, (spec, text_field)) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.apply_async(tokenize_item, (item,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ----------------------------------------------------------------------------- preparing


def prepare(sources: Sequence[str | Path], tokenizer: str | Tokenizer, out_dir: str | Path, *,
            text_field: str = "text", shard_tokens: int = 1 << 27, workers: int | None = None,
            chunk_bytes: int = 1 << 20, overwrite: bool = False,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Tokenize `sources` into shards under `out_dir`; returns the manifest (with `extra`'s
    keys added, e.g. the run folder cache's key of the inputs).
    `workers`: tokenizing processes (0 = this process; default: none for bytes, else
    the CPU count, at most 4)."""
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        # 0 would end a shard before writing a token (endless empty files), < 0 never
        raise DataError(f"shard_tokens must be a whole number >= 1, got {shard_tokens!r}")
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    out = Path(out_dir).expanduser()
    if out.exists() and not overwrite:
        raise DataError(f"output '{out}' exists; remove it or choose another output folder")
    inv = inventory(sources)
    items = plan_items(inv, chunk_bytes)
    if workers is None:  # bytes tokenize at disk speed: a pool would only add copies
        workers = 0 if hasattr(tok, "encode_bytes") else min(4, os.cpu_count() or 1)
    dtype = token_dtype(tok.vocab_size)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writer = ShardWriter(tmp, dtype, shard_tokens)
    text_bytes = docs = 0
    for tokens, nbytes, ended in tokenize_items(items, tok, text_field, min(workers, len(items))):
        writer.add(tokens)
        text_bytes, docs = text_bytes + nbytes, docs + ended
    shards = writer.close()
    if not shards:  # nothing to train on: say so now, not at the first training run
        shutil.rmtree(tmp, ignore_errors=True)
        names = ", ".join(f"'{s}'" for s in sources[:3]) + (" ..." if len(sources) > 3 else "")
        raise DataError(f"data.path {names} holds no text ({len(inv.files)} file(s), all "
                        "empty or without text); give non-empty text files, folders, .jsonl "
                        "or .parquet")
    manifest = write_manifest(tmp, {
        "tokenizer": tok.describe(), "vocab_size": tok.vocab_size, "dtype": dtype.name,
        "separator": separator(tok), "tokens": sum(s["tokens"] for s in shards),
        "documents": docs, "text_bytes": text_bytes, "shards": shards,
        "sources": inv.summary([str(s) for s in sources]), **(extra or {})})
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return manifest
