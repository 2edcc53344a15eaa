"""What the commands that run a config share (`train`, `lr-find`): their own flags pulled
out of a line of config overrides, the config loaded and checked, and the launch: here,
as one rank of torchrun, or as N local ranks started by this process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from zerotrain.cli.args import UsageError, parse_count

if TYPE_CHECKING:
    from zerotrain.config import Config

#: what every command that runs a config takes besides its own flags (all take a value)
CONFIG_FLAGS = ("--config", "--deepspeed", "--deepspeed_config", "--nproc")
#: what only the launcher acts on; under torchrun, torchrun's own flags decide these
LAUNCHER_FLAGS = ("--nproc", "--max-restarts")


class Job(NamedTuple):
    """What a config command runs: `body` here, or on each rank of a local launch, whose
    launcher first checks devices, run folder and data of `check` once (resuming
    `resume`), and restarts the ranks up to `restarts` times."""

    body: Callable[[], object]
    check: Config
    resume: str | None = None
    restarts: int = 0


def config_command(name: str, argv: list[str], flags: tuple[str, ...],
                   job: Callable[[dict[str, str], Config], Job],
                   bare: tuple[str, ...] = ()) -> int:
    """`zerotrain <name>` for a command that runs a config (train, lr-find).

    Our own flags (CONFIG_FLAGS and `flags`; each takes a value, which those in `bare`
    may lack) are pulled out by hand, because everything else on the line is a config
    override (`--optimizer.lr 3e-4`), whose names argparse cannot know. The config is
    loaded and validated, and `job(own flags, config)` says what to run. Under torchrun
    this rank dies with its launcher and runs it; with --nproc N > 1 (or restarts) the
    launcher checks once, then starts N ranks of this same command line; else it runs here.
    """
    opts, overrides = split_flags(argv, CONFIG_FLAGS + flags)
    for flag, value in opts.items():
        if value == "" and flag not in bare:
            raise UsageError(f"{flag} needs a value (see 'zerotrain {name} --help')")
    nproc = parse_count(opts["--nproc"], "--nproc") if "--nproc" in opts else 1
    todo = job(opts, load_config(opts, overrides, nproc))  # validated before launching
    from zerotrain.comm.dist import launched_by_torchrun

    if launched_by_torchrun():
        from zerotrain.run.lifecycle import die_with_parent

        die_with_parent()
        ignored = [f for f in LAUNCHER_FLAGS if f in opts]
        if ignored and os.environ.get("RANK", "0") == "0":
            print(f"zerotrain {name}: warning: {' and '.join(ignored)} ignored under "
                  "torchrun; give torchrun its own --nproc-per-node / --max-restarts",
                  file=sys.stderr)
    elif nproc > 1 or todo.restarts:
        from zerotrain.comm.launch import launch_local
        from zerotrain.run.setup import launch_checked

        with launch_checked(todo.check, todo.resume, nproc):  # one error, not one per rank
            rest = drop_flags(argv, LAUNCHER_FLAGS)
            return launch_local(nproc, [name, *rest], max_restarts=todo.restarts)
    todo.body()
    return 0


def split_flags(argv: list[str], flags: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """Pull our own flags (each takes a value: `--f V`, `--f=V`, or `--f` alone, read as
    "") out of argv; the rest are config overrides."""
    found: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, val = argv[i].partition("=")
        if name not in flags:
            rest.append(argv[i])
        elif name in found:  # the last one silently winning hides a mistake
            raise UsageError(f"{name} is given twice; give it once")
        elif eq:
            found[name] = val
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            found[name] = argv[i + 1]
            i += 1
        else:
            found[name] = ""
        i += 1
    return found, rest


def drop_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv without `flags` and their values (what ranks must not see again)."""
    out, skip = [], False
    for i, tok in enumerate(argv):
        if skip:
            skip = False
        elif tok in flags:
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        elif tok.partition("=")[0] not in flags:
            out.append(tok)
    return out


def load_config(opts: dict[str, str], overrides: list[str], nproc: int) -> Config:
    """The run's Config: from --config (zerotrain's) or --deepspeed (DeepSpeed's JSON),
    with the overrides; its logging backends checked before any rank starts."""
    from zerotrain.config import load_config as load
    from zerotrain.run.trackers import check_backends

    ds = opts.get("--deepspeed") or opts.get("--deepspeed_config")
    if ds is not None:
        if opts.get("--config"):
            raise UsageError("give --config or --deepspeed, not both")
        from zerotrain.deepspeed_config import load_deepspeed_config

        world = int(os.environ.get("WORLD_SIZE", nproc))
        cfg = load_deepspeed_config(ds, world_size=world, overrides=overrides)
    else:
        cfg = load(opts.get("--config") or None, overrides)
    check_backends(cfg.logging.backends)
    return cfg
