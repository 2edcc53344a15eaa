"""`zerotrain tokenizer train`: a byte-level BPE trained offline with Hugging Face
`tokenizers`, for `data.tokenizer` and `prepare --tokenizer`."""

from __future__ import annotations

import sys
from pathlib import Path

from zerotrain.cli.args import Parser, UsageError, command


def _parser() -> Parser:
    p = Parser("tokenizer", "Train tokenizers.")
    t = p.action(
        p.actions(), "train", "train a byte-level BPE on text, offline",
        "Train a byte-level BPE (with an <|endoftext|> token) on text files, "
        "folders, .jsonl or .parquet, streaming the text; seconds for tens of MB.",
        "zerotrain tokenizer train SOURCE... --vocab N --out TOKENIZER.json")
    t.add_argument("sources", nargs="+", metavar="SOURCE", help="text to learn from")
    t.add_argument("--vocab", type=int, required=True, metavar="N",
                   help="largest vocabulary size (>= 258: 256 bytes, end-of-text, merges); "
                   "a text with fewer recurring pairs gives fewer tokens, with a warning")
    t.add_argument("--out", required=True, metavar="FILE", help="output tokenizer.json")
    t.add_argument("--text-field", default="text", metavar="NAME",
                   help="the text column of .jsonl and .parquet inputs")
    return p


@command("tokenizer")
def main_tokenizer(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    if a.vocab < 258:
        raise UsageError(f"--vocab must be >= 258 (256 bytes + end-of-text + merges), "
                         f"got {a.vocab}")
    for src in a.sources:
        if not Path(src).expanduser().exists():
            raise UsageError(f"SOURCE '{src}' does not exist")
    from zerotrain.data.errors import DataError
    from zerotrain.data.sources import iter_texts
    from zerotrain.data.tokenizer import train_bpe

    try:
        tok = train_bpe(iter_texts(a.sources, a.text_field), a.vocab, a.out)
    except DataError as e:
        raise UsageError(str(e)) from None
    if tok.vocab_size < a.vocab:  # the text has no more merges: say so, once
        print(f"zerotrain tokenizer: warning: the text supplies only {tok.vocab_size:,} "
              f"tokens, fewer than --vocab {a.vocab:,} (no more pairs occur twice); the "
              "tokenizer has the smaller vocabulary", file=sys.stderr)
    print(f"wrote {a.out}: byte-level BPE, {tok.vocab_size:,} tokens")
    return 0
