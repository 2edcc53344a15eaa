"""`zerotrain convert --from-deepspeed DIR --out CKPT`: a DeepSpeed checkpoint folder
(ZeRO 0-3, DeepSpeed 0.19) as a zerotrain checkpoint, without the model's code.

The files are read with torch.load(weights_only=True) and an allow-list (see
zerotrain/deepspeed/checkpoint.py); the result loads at any world size and stage,
into `zerotrain.deepspeed` scripts (scheduler included) and `zerotrain.initialize`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from zerotrain.cli.args import Parser, UsageError, command


def _parser() -> Parser:
    p = Parser("convert", "Convert a DeepSpeed checkpoint into a zerotrain checkpoint: fp32 "
               "weights, optimizer moments and steps, global step and lr scheduler state.")
    p.add_argument("--from-deepspeed", required=True, metavar="DIR",
                   help="DeepSpeed save_checkpoint folder (follows its 'latest'), or one "
                   "global_stepN folder")
    p.add_argument("--tag", default=None, help="the tag to read instead of 'latest'")
    p.add_argument("--out", required=True, metavar="CKPT",
                   help="checkpoint root to write (the tag's folder goes inside)")
    return p


@command("convert")
def main_convert(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    made = _check_out(Path(a.out))
    from zerotrain.deepspeed.convert import convert

    try:
        path = convert(a.from_deepspeed, a.out, a.tag)
    except BaseException:
        for d in made:  # what the check made for --out, if the conversion wrote nothing
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    print(f"wrote {path}")
    return 0


def _check_out(out: Path) -> list[Path]:
    """--out must be a directory this process can write, checked (by making it) before
    the checkpoint is read; returns the directories made, deepest first."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out '{out}' is a file: give a directory (the checkpoint root "
                         "to write; the tag's folder goes inside)")
    made = [d for d in (out, *out.parents) if not d.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".zerotrain-write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"--out '{out}': cannot write there ({e.strerror or e}): give a "
                         "writable directory") from None
    return made
