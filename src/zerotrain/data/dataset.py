"""From `data.path` + `data.tokenizer` to what the sampler reads: one entry point for training.

- A token-shard folder (from `prepare`): opened, checked against the tokenizer, split
  into train/validation views; nothing is loaded.
- The byte tokenizer on the embedded corpus or a legacy `.bin`: exactly today's path
  (`corpus.load_tokens` + `train_val_split`).
- Anything else (text, folders, .jsonl, .parquet with any tokenizer): tokenized in this
  process into one array, which is right for corpora of a few hundred MB at most; larger
  ones should be prepared into shards once.
`resolve_tokenizer` turns `bpe:N` into a trained tokenizer.json in a cache folder (the
run directory), reused on resume; `cached_shards` tokenizes text once into shards there,
so ranks share one tokenization instead of each holding its own.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from zerotrain.data.corpus import DataError, load_tokens, stdlib_sources, train_val_split
from zerotrain.data.shards import prepare, tokenize_items
from zerotrain.data.sources import inventory, iter_texts, plan_items
from zerotrain.data.token_shards import (
    ShardSplit,
    TokenShards,
    is_byte_file,
    is_shard_folder,
    read_manifest,
    token_dtype,
)
from zerotrain.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    train_bpe,
)

TOKENIZER_FILE = "tokenizer.json"
BPE_RECORD = "tokenizer.bpe.json"  # the bpe:N a run-folder tokenizer was trained for
SHARDS_DIR = "tokens"


def _sources(path: str | Path | None) -> Sequence[str | Path]:
    return stdlib_sources() if path is None else [path]


def tokenize(sources: Sequence[str | Path], tok: Tokenizer, text_field: str = "text",
             workers: int = 0) -> np.ndarray:
    """The whole token stream of `sources` in memory (documents separated as in shards)."""
    items = plan_items(inventory(sources))
    parts = [t for t, _, _ in tokenize_items(items, tok, text_field, workers)]
    return np.concatenate(parts) if parts else np.zeros(0, token_dtype(tok.vocab_size))


def resolve_tokenizer(spec: str, data_path: str | Path | None = None,
                      cache_dir: str | Path | None = None, text_field: str = "text") -> Tokenizer:
    """`bytes`, a path, or `bpe:N`: train an N-token BPE on the training text into
    `cache_dir/tokenizer.json` the first time, load it afterwards. With several ranks,
    call it on rank 0 first, then (after a barrier) on the others.

    A corpus may supply fewer than N tokens; the tokenizer trained then is smaller, and
    `tokenizer.bpe.json` beside it records the N it was trained for, so every later run
    with the same `bpe:N` (a resume, a restarted rank) accepts it."""
    if not spec.startswith("bpe:"):
        return load_tokenizer(spec)
    n = int(spec[4:])
    if cache_dir is None:
        raise DataError(f"data.tokenizer {spec} needs a folder to keep the trained tokenizer in")
    out = Path(cache_dir) / TOKENIZER_FILE
    if out.is_file():
        tok = HFTokenizer.from_file(out)
        if tok.vocab_size != n and bpe_request(out, tok) != n:
            raise DataError(
                f"'{out}' has {tok.vocab_size} tokens but data.tokenizer is {spec}; to go on "
                f"with the run that trained it pass --data.tokenizer {out}, or start a new "
                "tokenizer in another logging.run_dir (or with --logging.overwrite true)")
        return tok
    if data_path is not None and is_shard_folder(data_path):
        raise DataError(f"data.tokenizer {spec} trains on text, but data.path '{data_path}' "
                        "holds tokens; pass the tokenizer the shards were prepared with")
    tok = train_bpe(iter_texts(_sources(data_path), text_field), n, out)
    record = {"requested": n, "vocab_size": tok.vocab_size, "sha256": tok.sha256}
    out.with_name(BPE_RECORD).write_text(json.dumps(record, indent=1))
    return tok


def bpe_request(path: Path, tok: HFTokenizer) -> int | None:
    """The N of the `bpe:N` that trained the tokenizer at `path` here (None: unknown, or
    the file was replaced since)."""
    try:
        rec = json.loads(path.with_name(BPE_RECORD).read_text())
        return int(rec["requested"]) if rec.get("sha256") == tok.sha256 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_caches(cache_dir: str | Path, data_path: str | Path | None, spec: str) -> list[Path]:
    """Remove what training made in `cache_dir` from the data (a `bpe:N` tokenizer and
    the token shards), for a run that replaces the folder's run: it must not train on
    tokens of an older corpus. Only zerotrain's own files go: the tokenizer when zerotrain
    trained it (its record, or this run asks for bpe:N) and data.tokenizer does not name
    it; the shards when `cached_shards` made them and data.path does not point into them."""
    d = Path(cache_dir)
    gone: list[Path] = []

    def used(p: Path, given: str | Path | None) -> bool:
        if given is None:
            return False
        g = Path(given).expanduser().resolve()
        return g == p.resolve() or p.resolve() in g.parents

    tok_file = d / TOKENIZER_FILE
    ours = (d / BPE_RECORD).is_file() or spec.startswith("bpe:")
    if tok_file.is_file() and ours and \
            not used(tok_file, None if spec.startswith("bpe:") else spec):
        for f in (tok_file, d / BPE_RECORD):
            f.unlink(missing_ok=True)
        gone.append(tok_file)
    shards = d / SHARDS_DIR
    if is_shard_folder(shards) and not used(shards, data_path):
        try:
            made_here = "cache_key" in read_manifest(shards)
        except (OSError, DataError):
            made_here = False
        if made_here:
            shutil.rmtree(shards, ignore_errors=True)
            gone.append(shards)
    return gone


def source_key(sources: Sequence[str | Path]) -> str:
    """What identifies the content of the inputs without reading it: every file's path,
    size and modification time (an edited or replaced file changes it)."""
    h = hashlib.sha256()
    for kind, f in inventory(sources).files:
        st = f.stat()
        h.update(f"{kind}\0{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


Split = np.ndarray | ShardSplit


def load_splits(path: str | Path | None, tok: Tokenizer, val_fraction: float,
                text_field: str = "text") -> tuple[Split, Split]:
    """(train, validation) token sources for `WindowSampler` / `eval_batches`."""
    if path is not None and is_shard_folder(path):
        return TokenShards(path, tok).split(val_fraction)
    legacy_bin = is_byte_file(path)
    if isinstance(tok, ByteTokenizer) and (path is None or legacy_bin):
        return train_val_split(load_tokens(path), val_fraction)
    if legacy_bin:
        raise DataError(f"'{path}' holds byte tokens; use data.tokenizer bytes, or prepare "
                        "token shards with this tokenizer (`zerotrain prepare --tokenizer`)")
    tokens = tokenize(_sources(path), tok, text_field)
    if not len(tokens):
        raise DataError(f"data.path '{path}' holds no text")
    return train_val_split(tokens, val_fraction)


def needs_shards(path: str | Path | None, tok: Tokenizer) -> bool:
    """Whether training reads `path` through token shards made once in the run folder:
    everything but bytes of the embedded corpus or a `.bin`, and shards already made."""
    if path is not None and is_shard_folder(path):
        return False
    legacy = path is None or is_byte_file(path)
    return not (isinstance(tok, ByteTokenizer) and legacy)


def cached_shards(path: str | Path | None, tok: Tokenizer, cache_dir: str | Path,
                  text_field: str = "text", notes: list[str] | None = None) -> Path:
    """Token shards of data.path (or the embedded corpus) under `cache_dir/tokens`,
    prepared once and reused while the inputs' content (`source_key`) and the tokenizer
    are the same. Call on rank 0 first; after a barrier the other ranks get the same
    folder back. A rebuild of an existing cache adds a line to `notes`."""
    if path is not None and is_shard_folder(path):
        return Path(path)
    out = Path(cache_dir) / SHARDS_DIR
    sources = _sources(path)
    inputs = [str(s) for s in sources]
    key = source_key(sources)
    if is_shard_folder(out):
        try:
            shards = TokenShards(out, tok)
            if shards.manifest.get("cache_key") == key:
                return out
            if shards.manifest["sources"]["inputs"] == inputs and notes is not None:
                where = "the embedded corpus" if path is None else f"'{path}'"
                notes.append(f"[zerotrain] data: {where} changed since its tokens were "
                             f"cached in '{out}'; tokenizing it again")
        except DataError:
            pass  # another tokenizer: prepare again
    prepare(inputs, tok, out, text_field=text_field, overwrite=True,
            extra={"cache_key": key})
    return out


def describe(path: str | Path | None, tok: Tokenizer) -> str:
    """One line on what training reads: files and bytes in, tokens out."""
    if path is not None and is_shard_folder(path):
        m = read_manifest(path)
        files = sum(m["sources"]["files"].values())
        skipped = m["sources"].get("skipped", 0)
        return (f"{files:,} files ({skipped} skipped), {m['text_bytes']:,} bytes of text -> "
                f"{m['tokens']:,} tokens of {tok.name} in {len(m['shards'])} shard(s) at "
                f"'{path}'")
    if is_byte_file(path):
        size = Path(path).stat().st_size
        return f"'{path}': {size // 2:,} byte tokens"
    files = [f for _, f in inventory(_sources(path)).files]
    size = sum(f.stat().st_size for f in files)
    where = "the embedded corpus" if path is None else f"'{path}'"
    return f"{where}: {len(files):,} files, {size:,} bytes, as {tok.name} tokens"
