"""`zerotrain export`: one safetensors file of consolidated weights, loadable without us."""

from __future__ import annotations

from pathlib import Path

from zerotrain.cli.args import Parser, UsageError, command

DTYPES = ("fp32", "bf16", "fp16")


def _parser() -> Parser:
    p = Parser("export", "Consolidate a sharded checkpoint (any stage or world size) into "
               "one safetensors file that model.load_state_dict() accepts and whose metadata "
               "carries the model config; or, with --format hf, a Hugging Face folder "
               "(config.json + model.safetensors) that from_pretrained() loads.")
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="checkpoint root (follows 'latest'), one step_* folder, or the run "
                   "folder holding checkpoints/")
    p.add_argument("--out", required=True, metavar="PATH",
                   help="output .safetensors file (plain), or output folder (--format hf)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="dtype of the weights")
    p.add_argument("--format", choices=("plain", "hf"), default="plain",
                   help="plain: one safetensors file; hf: a Hugging Face model folder")
    return p


@command("export")
def main_export(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    out = Path(a.out).expanduser()
    if a.format == "plain" and out.is_dir():
        raise UsageError(f"--out '{a.out}' is a directory; give a file path such as "
                         f"{out / 'model.safetensors'} (or --format hf for a folder)")
    if a.format == "hf" and out.is_file():
        raise UsageError(f"--out '{a.out}' is a file; --format hf writes a folder")
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    written = _hf(a.checkpoint, out, dtype) if a.format == "hf" else _plain(a.checkpoint, out,
                                                                            dtype)
    size = sum(f.stat().st_size for f in written.rglob("*")) if written.is_dir() \
        else written.stat().st_size
    print(f"wrote {written} ({size:,} bytes, {a.dtype})")
    return 0


def _plain(ckpt: str, out: Path, dtype) -> Path:
    from zerotrain.checkpoint import export

    return export(ckpt, out, dtype)


def _hf(ckpt: str, out: Path, dtype) -> Path:
    import shutil

    from zerotrain.checkpoint import full_state_dict
    from zerotrain.config import ModelConfig
    from zerotrain.models.hf_export import save_hf

    sd, meta = full_state_dict(ckpt)
    extra = meta.get("extra", {})
    cfg = ModelConfig.model_validate(meta["config"]["model"])
    folder = save_hf(out, cfg, sd, dtype, hf_config=extra.get("hf_config"))
    spec = extra.get("tokenizer", {}).get("spec", "bytes")
    if spec != "bytes" and Path(spec).is_file():  # the run's tokenizer goes along
        shutil.copy(spec, folder / "tokenizer.json")
    return folder
