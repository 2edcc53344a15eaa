"""`zerotrain prepare`: tokenise text once, into token shards (or a byte .bin) for
--data.path; memory stays bounded whatever the corpus size."""

from __future__ import annotations

import argparse
from pathlib import Path

from zerotrain.cli.args import Parser, UsageError, command, rename_fields


def _parser() -> Parser:
    p = Parser("prepare", "Tokenise text files, folders, .jsonl (a text field) or .parquet "
               "into token shards with a manifest (tokenizer, counts, checksums), streaming: "
               "the corpus is never held in memory. Train on them with --data.path DIR. "
               "With --out FILE.bin and the byte tokenizer: one uint16 file instead.")
    p.add_argument("sources", nargs="*", metavar="SOURCE",
                   help="text files, folders, .jsonl or .parquet (default: the embedded "
                   "corpus, this interpreter's standard-library sources)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="output folder of shards (or FILE.bin for a byte-token file)")
    p.add_argument("--tokenizer", default="bytes", metavar="T",
                   help="bytes, a tokenizer.json, or a Hugging Face tokenizer folder")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the text column of .jsonl and .parquet inputs")
    p.add_argument("--shard-tokens", type=_positive, default=1 << 27, metavar="N",
                   help="tokens per shard (at least 1)")
    p.add_argument("--workers", type=_non_negative, default=None, metavar="N",
                   help="tokenizing processes (default: none for bytes, else up to 4)")
    return p


def _whole(text: str, least: int) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {n}")
    return n


def _positive(text: str) -> int:
    return _whole(text, 1)


def _non_negative(text: str) -> int:
    return _whole(text, 0)


@command("prepare")
def main_prepare(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    for src in a.sources:
        if not Path(src).expanduser().exists():
            raise UsageError(f"SOURCE '{src}' does not exist; give text files, folders, "
                             ".jsonl or .parquet")
    from zerotrain.data.errors import DataError

    try:
        if a.out.endswith(".bin"):
            return _bin(a)
        from zerotrain.data.corpus import stdlib_sources
        from zerotrain.data.shards import prepare

        sources = a.sources or stdlib_sources()
        m = prepare(sources, a.tokenizer, a.out, text_field=a.text_field,
                    shard_tokens=a.shard_tokens, workers=a.workers)
    except DataError as e:  # its messages speak of the config field; here it is SOURCE
        raise UsageError(rename_fields(str(e), {"data.path": "SOURCE"})) from None
    tokens = sum(s["tokens"] for s in m["shards"])
    print(f"wrote {a.out}: {tokens:,} tokens in {len(m['shards'])} shard(s) "
          f"(vocab {m['vocab_size']}, {m['dtype']})")
    return 0


def _bin(a) -> int:
    if a.tokenizer != "bytes" or len(a.sources) > 1:
        raise UsageError("--out FILE.bin holds byte tokens of one SOURCE; for another "
                         "tokenizer or several sources give an output folder")
    from zerotrain.data.corpus import prepare

    meta = prepare(a.sources[0] if a.sources else None, a.out)
    print(f"wrote {a.out}: {meta['tokens']:,} tokens (vocab {meta['vocab_size']})")
    return 0
