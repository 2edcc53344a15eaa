"""`zerotrain train`: validate the config, then train here or on --nproc local ranks.

Our own flags are pulled out by hand (`_split_known`), because everything else on the
line is a config override (`--optimizer.lr 3e-4`), whose names argparse cannot know.
"""

from __future__ import annotations

import textwrap

from zerotrain.cli.args import Parser, UsageError, command

# One line per config section, for `train --help` (a test keeps it equal to Config's).
SECTIONS = {
    "model": "family (gpt, llama, preset, Hugging Face folder), sizes, init weights",
    "data": "corpus, validation split, micro-batch and accumulation",
    "sequence": "long sequences: loss and MLP computed in tiles of N tokens",
    "optimizer": "update rule and its hyperparameters, gradient clipping",
    "schedule": "learning rate: warmup, hold, decay, floor",
    "precision": "fp32, bf16 or fp16 compute; loss scaling",
    "zero": "ZeRO stage, offload, buckets, overlap, prefetch",
    "comm": "backend and collective algorithm (native or ring)",
    "checkpoint": "how often to save, how many to keep",
    "logging": "run folder, progress bar, evaluation, samples",
    "train": "steps, seed, device, threads",
}


def _sections_text() -> str:
    from zerotrain.config import Config

    lines = ["config sections (override any field as --section.key VALUE):"]
    for name, info in Config.model_fields.items():
        keys = ", ".join(info.annotation.model_fields)  # type: ignore[union-attr]
        lines.append(f"  {name:<12}{SECTIONS.get(name, '')}")
        lines += textwrap.wrap(keys, 78, initial_indent=" " * 16, subsequent_indent=" " * 16)
    return "\n".join(lines)


def help_text() -> str:
    p = Parser("train", "Train a language model (the reference GPT, llama, a preset or a "
               "Hugging Face model). Every config field can be overridden on "
               "the command line, e.g. --optimizer.lr 3e-4 --zero.stage 2.",
               usage="zerotrain train [--config FILE] [--nproc N] [--resume [CKPT|auto]]\n"
                     "                       [--deepspeed FILE] [--max-restarts K] "
                     "[--section.key VALUE ...]",
               epilog=_sections_text() + "\n\nSee the resolved values with `zerotrain config "
               "show [the same flags]`; the stages are explained in docs/design.md §zero.")
    p.add_argument("--config", metavar="FILE", help="YAML or JSON config; flags override it")
    p.add_argument("--nproc", metavar="N", help="start N local ranks through torchrun's own "
                   "machinery (standalone rendezvous); default: this one process")
    p.add_argument("--resume", metavar="CKPT|auto", nargs="?",
                   help="continue from a checkpoint: alone, the run's latest one in "
                   "logging.run_dir; a path, that checkpoint; 'auto', the latest if one "
                   "exists, else start fresh (for preemptible jobs)")
    p.add_argument("--deepspeed", metavar="FILE", help="take the settings from a DeepSpeed "
                   "JSON config (batch, ZeRO, precision, optimizer, scheduler)")
    p.add_argument("--max-restarts", metavar="K", help="restart the ranks up to K times "
                   "after a failure; they resume from the last complete checkpoint")
    return p.format_help()


def _split_known(argv: list[str], flags: dict[str, bool]) -> tuple[dict, list[str]]:
    """Pull our own flags (name -> takes_value) out; the rest are config overrides."""
    found: dict[str, str | bool] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, val = tok.partition("=")
        if name in flags:
            if name in found:  # the last one silently winning hides a mistake
                raise UsageError(f"{name} is given twice; give it once")
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


def _load(opts: dict, overrides: list[str], nproc: int):
    """The run's Config: from --config (zerotrain's) or --deepspeed (DeepSpeed's JSON)."""
    from zerotrain.config import load_config
    from zerotrain.trackers import check_backends

    ds = opts.get("--deepspeed") or opts.get("--deepspeed_config")
    if ds is not None:
        if opts.get("--config"):
            raise UsageError("give --config or --deepspeed, not both")
        if ds == "":
            raise UsageError("--deepspeed needs the path of a DeepSpeed JSON config")
        import os

        from zerotrain.deepspeed_config import load_deepspeed_config

        world = int(os.environ.get("WORLD_SIZE", nproc))
        cfg = load_deepspeed_config(ds, world_size=world, overrides=overrides)
    else:
        cfg = load_config(opts.get("--config") or None, overrides)
    check_backends(cfg.logging.backends)
    return cfg


def _count(flag: str, text: str | bool, least: int = 0) -> int:
    try:
        n = int(text)
    except ValueError:
        raise UsageError(f"{flag} must be a whole number, got {text!r}") from None
    if n < least:
        raise UsageError(f"{flag} must be >= {least}, got {n}")
    return n


def _nproc(text: str | bool) -> int:
    return _count("--nproc", text, least=1)


@command("train")
def main_train(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    opts, overrides = _split_known(argv, {
        "--config": True, "--nproc": True, "--resume": True, "--deepspeed": True,
        "--deepspeed_config": True, "--max-restarts": True})
    if opts.get("--nproc") == "":
        raise UsageError("--nproc needs a number of ranks, e.g. --nproc 2")
    nproc = _nproc(opts["--nproc"]) if "--nproc" in opts else 1
    restarts = _count("--max-restarts", opts.get("--max-restarts", "0"))
    cfg = _load(opts, overrides, nproc)  # validate before launching
    resume = opts.get("--resume")
    resume = None if resume is None else str(resume)
    if resume is not None and cfg.logging.overwrite:
        raise UsageError("--resume continues the run in logging.run_dir, "
                         "--logging.overwrite true replaces it; give one of them")
    from zerotrain.comm.dist import launched_by_torchrun

    if launched_by_torchrun():
        import os
        import sys

        from zerotrain.lifecycle import die_with_parent

        die_with_parent()
        ignored = [f for f in ("--nproc", "--max-restarts") if f in opts]
        if ignored and os.environ.get("RANK", "0") == "0":  # torchrun decides these here
            print(f"zerotrain train: warning: {' and '.join(ignored)} ignored under torchrun; "
                  "give torchrun its own --nproc-per-node / --max-restarts", file=sys.stderr)
    elif nproc > 1 or restarts:
        from zerotrain.comm.launch import launch_local
        from zerotrain.train import launch_checked

        with launch_checked(cfg, resume, nproc):  # one error now, not one per rank later
            rest = _drop_flag(_drop_flag(argv, "--nproc"), "--max-restarts")
            return launch_local(nproc, ["train", *rest], max_restarts=restarts)
    from zerotrain.train import train

    train(cfg, resume=resume)
    return 0
