"""`zerotrain train`: validate the config, then train here or on --nproc local ranks.

Our own flags are pulled out of the config overrides as `run_command.config_command`
does for every command that runs a config; argparse here only prints the help.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from zerotrain.cli.args import Parser, UsageError, command, parse_count
from zerotrain.cli.run_command import Job, config_command

if TYPE_CHECKING:
    from zerotrain.config import Config

# One line per config section, for `train --help` (a test keeps it equal to Config's).
SECTIONS = {
    "model": "gpt or llama, by sizes, a named preset or a Hugging Face folder",
    "data": "corpus, tokenizer, validation split, micro-batch, accumulation",
    "sequence": "long sequences: loss and MLP in tiles of N tokens; Ulysses parallelism",
    "optimizer": "AdamW, Adam, SGD, Adagrad, RMSprop, Lion or Muon; clipping",
    "schedule": "learning rate: warmup, hold, decay (cosine, linear, WSD), floor",
    "precision": "fp32, bf16 or fp16 compute; loss scaling; FP8 matmuls, all-gather",
    "zero": "ZeRO stage, optimizer offload, buckets, overlap, prefetch",
    "comm": "backend, collective algorithm (native or ring), timeout, lockstep",
    "checkpoint": "where and how often to save, how many to keep",
    "logging": "run folder, metrics backends, progress, evaluation, plot, sample",
    "train": "steps, seed, device, threads, divergence limits, fault injection",
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
    p = Parser("train", "Train a language model (the reference GPT or llama, sized by hand "
               "or by a named preset, or a Hugging Face model). Every config field can be "
               "overridden on the command line, e.g. --optimizer.lr 3e-4 --zero.stage 2.",
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


def _job(opts: dict[str, str], cfg: Config) -> Job:
    restarts = parse_count(opts.get("--max-restarts", "0"), "--max-restarts", minimum=0)
    resume = opts.get("--resume")  # "" (the flag alone): the run's latest checkpoint
    if resume is not None and cfg.logging.overwrite:
        raise UsageError("--resume continues the run in logging.run_dir, "
                         "--logging.overwrite true replaces it; give one of them")
    from zerotrain.run.loop import train

    return Job(lambda: train(cfg, resume=resume), cfg, resume, restarts)


@command("train")
def main_train(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    return config_command("train", argv, ("--resume", "--max-restarts"), _job,
                          bare=("--resume",))
