"""`zerotrain prepare`: tokenise text once into a .bin that --data.path reads as a memmap."""

from __future__ import annotations

from pathlib import Path

from zerotrain.cli.args import Parser, UsageError, command, rename_fields


def _parser() -> Parser:
    p = Parser("prepare", "Tokenise text (bytes, vocab 256) into a uint16 .bin plus a .json "
               "sidecar; train on it with --data.path FILE.bin.")
    p.add_argument("source", nargs="?", default=None, metavar="SOURCE",
                   help="text file or folder of text files (default: the embedded corpus, "
                   "this interpreter's standard-library sources)")
    p.add_argument("--out", required=True, metavar="FILE.bin", help="output token file")
    return p


@command("prepare")
def main_prepare(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    if a.source is not None and not Path(a.source).expanduser().exists():
        raise UsageError(f"SOURCE '{a.source}' does not exist; give a text file or a folder "
                         "of text files")
    from zerotrain.data.corpus import DataError, prepare

    try:
        meta = prepare(a.source, a.out)
    except DataError as e:  # its messages speak of the config field; here it is SOURCE
        raise UsageError(rename_fields(str(e), {"data.path": "SOURCE"})) from None
    print(f"wrote {a.out}: {meta['tokens']:,} tokens (vocab {meta['vocab_size']})")
    return 0
