"""`zerotrain convert --from-deepspeed DIR --out CKPT`: a DeepSpeed checkpoint folder
(ZeRO 0-3, DeepSpeed 0.19) as a zerotrain checkpoint, without the model's code.

The files are read with torch.load(weights_only=True) and an allow-list (see
zerotrain/deepspeed/checkpoint.py); the result loads at any world size and stage,
into `zerotrain.deepspeed` scripts (scheduler included) and `zerotrain.initialize`.
"""

from __future__ import annotations

from zerotrain.cli.args import Parser, command


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
    from zerotrain.deepspeed.convert import convert

    path = convert(a.from_deepspeed, a.out, a.tag)
    print(f"wrote {path}")
    return 0
