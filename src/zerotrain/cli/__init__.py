"""The `zerotrain` command: a table of subcommands, each in its own module of this package.

A subcommand's module is imported only when it runs, so `zerotrain float` does not pay
for torch. Errors a user can fix are one line (`zerotrain <command>: error: ...`, exit
status 2, see `args.command`); output piped into `head` ends quietly.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import NamedTuple

from zerotrain.cli.args import Main

__all__ = ["COMMANDS", "main"]


class Command(NamedTuple):
    target: str  # "module.function" under zerotrain.cli
    summary: str
    group: str


def _table(group: str, rows: dict[str, tuple[str, str]]) -> dict[str, Command]:
    return {name: Command(target, summary, group) for name, (target, summary) in rows.items()}


COMMANDS: dict[str, Command] = {
    **_table("Train and use a model:", {
        "train": ("train.main_train", "train a model (one process, or --nproc N ranks)"),
        "launch": ("launch.main_launch", "run your own training script on N local ranks "
                   "(torchrun underneath; DeepSpeed's launcher in shape)"),
        "lr-find": ("lr_find.main_lr_find", "learning-rate range test: loss against lr, "
                    "and a suggested peak lr"),
        "config": ("config.main_config", "show the config a run would use, fully resolved; "
                   "read a DeepSpeed config"),
        "prepare": ("prepare.main_prepare", "turn text into token shards for --data.path"),
        "tokenizer": ("tokenizer.main_tokenizer", "train a byte-level BPE tokenizer"),
        "sample": ("sample.main_sample", "generate text from a checkpoint"),
        "export": ("export.main_export",
                   "write a checkpoint's weights: one safetensors file or a HF folder"),
        "convert": ("convert.main_convert", "turn a DeepSpeed checkpoint into a zerotrain "
                    "checkpoint"),
    }),
    **_table("See how each mechanism works:", {
        "float": ("floats.main_float", "how a number is stored in a float format, bit by bit"),
        "formats": ("floats.main_formats", "range and precision of every float format"),
        "schedule": ("schedule.main_schedule", "the learning rate over a run, and a plot"),
        "ring": ("ring.main_ring", "ring all-reduce step by step, and the traffic it saves"),
        "estimate": ("estimate.main_estimate", "memory and traffic per GPU for each ZeRO "
                     "stage; what fits"),
    }),
}


def usage() -> str:
    """The top-level help: what each command does for a user."""
    width = max(map(len, COMMANDS)) + 2
    lines = ["usage: zerotrain COMMAND [ARGS ...]", "",
             "zerotrain trains language models with data parallelism and ZeRO, and explains",
             "every mechanism it uses (float formats, schedules, ring all-reduce, memory)."]
    for group in dict.fromkeys(c.group for c in COMMANDS.values()):
        lines += ["", group]
        lines += [f"  {name:<{width}}{c.summary}" for name, c in COMMANDS.items()
                  if c.group == group]
    lines += ["", "Options:", f"  {'-h, --help':<{width + 4}}show this help",
              f"  {'--version':<{width + 4}}print the version", "",
              "`zerotrain COMMAND --help` lists a command's options with their defaults.",
              "Background for every number printed: docs/design.md."]
    return "\n".join(lines)


def _lookup(name: str) -> Main:
    module, function = COMMANDS[name].target.rsplit(".", 1)
    return getattr(importlib.import_module(f"zerotrain.cli.{module}"), function)


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        from zerotrain import __version__

        print(f"zerotrain {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        from zerotrain.cli.args import fail

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        return fail("", f"unknown command '{name}'{hint} (commands: {', '.join(COMMANDS)})")
    return _lookup(name)(rest)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `zerotrain` script and of `python -m zerotrain`."""
    try:
        code = _dispatch(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # a closed pipe shows up here, not at interpreter exit
        return code
    except BrokenPipeError:
        # The reader (e.g. `head`) has all it wanted. Point stdout at /dev/null so the
        # final flush at exit is silent, and exit as a program killed by SIGPIPE would.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
