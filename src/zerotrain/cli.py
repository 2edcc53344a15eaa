"""The `zerotrain` command. Each subcommand is a thin door into one module.

    train     train the reference GPT (--nproc N for N local ranks)
    sample    generate text from a checkpoint
    export    consolidated weights from a sharded checkpoint -> one safetensors file
    prepare   tokenise text into a .bin for --data.path
    config    show the fully resolved config
    schedule  print / plot a learning-rate schedule
    float     explain how a number is stored in a float format (or decode --bits)
    formats   compare float formats, derived from their layouts
    ring      walk through ring all-reduce, step by step
    estimate  memory and traffic per stage, or the largest model that fits
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable


def _user_errors() -> tuple[type[BaseException], ...]:
    from zerotrain.checkpoint.io import CheckpointError
    from zerotrain.config import ConfigError
    from zerotrain.data.corpus import DataError
    from zerotrain.numerics.scaler import LossScaleError

    return (ConfigError, DataError, CheckpointError, LossScaleError)


def _split_known(argv: list[str], flags: dict[str, bool]) -> tuple[dict, list[str]]:
    """Pull our own flags (name -> takes_value) out; the rest are config overrides."""
    found: dict[str, str | bool] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, val = tok.partition("=")
        if name in flags:
            if flags[name]:
                if eq:
                    found[name] = val
                elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    found[name] = argv[i + 1]
                    i += 1
                else:
                    found[name] = ""
            else:
                found[name] = True
            i += 1
            continue
        rest.append(tok)
        i += 1
    return found, rest


def _drop_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for i, tok in enumerate(argv):
        if skip:
            skip = False
        elif tok == flag:
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        elif not tok.startswith(flag + "="):
            out.append(tok)
    return out


def cmd_train(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("usage: zerotrain train [--config FILE] [--nproc N] [--resume [CKPT]] "
              "[--section.key VALUE ...]\n\nEvery config field can be overridden, e.g. "
              "--optimizer.lr 3e-4 --zero.stage 2; see `zerotrain config show`.")
        return 0
    from zerotrain.config import load_config

    opts, overrides = _split_known(argv, {"--config": True, "--nproc": True, "--resume": True})
    cfg = load_config(opts.get("--config") or None, overrides)  # validate before launching
    nproc = opts.get("--nproc")
    if nproc not in (None, "", "1"):
        from zerotrain.comm.dist import launched_by_torchrun
        from zerotrain.comm.launch import launch_local

        if not launched_by_torchrun():
            try:
                n = int(nproc)
            except ValueError:
                raise_usage(f"--nproc must be an integer, got {nproc!r}")
            return launch_local(n, ["train", *_drop_flag(argv, "--nproc")])
    from zerotrain.train import train

    resume = opts.get("--resume")
    train(cfg, resume=None if resume is None else str(resume))
    return 0


def raise_usage(msg: str) -> None:
    from zerotrain.config import ConfigError

    raise ConfigError(msg)


def cmd_config(argv: list[str]) -> int:
    from zerotrain.config import load_config

    if not argv or argv[0] != "show":
        raise_usage("usage: zerotrain config show [--config FILE] [--json] [overrides]")
    opts, overrides = _split_known(argv[1:], {"--config": True, "--json": False})
    cfg = load_config(opts.get("--config") or None, overrides)
    if opts.get("--json"):
        print(json.dumps(cfg.to_dict(), indent=2))
    else:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip())
    return 0


def cmd_sample(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="zerotrain sample")
    p.add_argument("--checkpoint", required=True, help="checkpoint root or step folder")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    import torch

    from zerotrain.checkpoint import full_state_dict
    from zerotrain.config import build_config
    from zerotrain.data.corpus import decode, encode
    from zerotrain.models.gpt import GPT

    sd, meta = full_state_dict(a.checkpoint)
    model = GPT(build_config(meta["config"]).model)
    model.load_state_dict(sd)
    model.eval()
    idx = torch.from_numpy(encode(a.prompt).astype("int64"))[None]
    g = torch.Generator().manual_seed(a.seed)
    out = model.generate(idx, a.tokens, temperature=a.temperature, top_k=a.top_k, generator=g)
    print(decode(out[0].tolist()))
    return 0


def cmd_export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="zerotrain export")
    p.add_argument("checkpoint", help="checkpoint root or step folder (any stage/world size)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    a = p.parse_args(argv)
    import torch

    from zerotrain.checkpoint import export

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    out = export(a.checkpoint, a.out, dtype)
    print(f"wrote {out} ({out.stat().st_size:,} bytes, {a.dtype})")
    return 0


def cmd_prepare(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="zerotrain prepare")
    p.add_argument("source", nargs="?", default=None,
                   help="text file or folder (default: the embedded stdlib corpus)")
    p.add_argument("--out", required=True, help="output .bin (uint16 tokens)")
    a = p.parse_args(argv)
    from zerotrain.data.corpus import prepare

    meta = prepare(a.source, a.out)
    print(f"wrote {a.out}: {meta['tokens']:,} tokens (vocab {meta['vocab_size']})")
    return 0


def _delegate(module: str, func: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        import importlib

        return getattr(importlib.import_module(module), func)(argv)
    return run


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": cmd_train,
    "sample": cmd_sample,
    "export": cmd_export,
    "prepare": cmd_prepare,
    "config": cmd_config,
    "schedule": _delegate("zerotrain.optim.schedule", "main_schedule"),
    "float": _delegate("zerotrain.numerics.float_cli", "main_float"),
    "formats": _delegate("zerotrain.numerics.float_cli", "main_formats"),
    "ring": _delegate("zerotrain.comm.ring_explain", "main_ring"),
    "estimate": _delegate("zerotrain.estimate", "main_estimate"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__.strip().replace("The `zerotrain` command.", "usage: zerotrain COMMAND ..."))
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(cmd, COMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(f"zerotrain: error: unknown command '{cmd}'{hint} (commands: "
              f"{', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    try:
        return COMMANDS[cmd](rest)
    except _user_errors() as e:
        print(f"zerotrain {cmd}: error: {e}", file=sys.stderr)
        return 2
