"""`zerotrain export`: one safetensors file of consolidated weights, loadable without us."""

from __future__ import annotations

from pathlib import Path

from zerotrain.cli.args import Parser, UsageError, command

DTYPES = ("fp32", "bf16", "fp16")


def _parser() -> Parser:
    p = Parser("export", "Consolidate a sharded checkpoint (any stage or world size) into "
               "one safetensors file that model.load_state_dict() accepts.")
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="checkpoint root (follows 'latest'), one step_* folder, or the run "
                   "folder holding checkpoints/")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="output .safetensors file (not an existing directory)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="dtype of the weights")
    return p


@command("export")
def main_export(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    out = Path(a.out).expanduser()
    if out.is_dir():
        raise UsageError(f"--out '{a.out}' is a directory; give a file path such as "
                         f"{out / 'model.safetensors'}")
    import torch

    from zerotrain.checkpoint import export

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    written = export(a.checkpoint, out, dtype)
    print(f"wrote {written} ({written.stat().st_size:,} bytes, {a.dtype})")
    return 0
