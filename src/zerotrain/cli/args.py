"""What every command shares: one parser class, one usage error, one way to fail, and the
readers of sizes and counts.

Every mistake a user can make on the command line, and every config, data or checkpoint
problem the library reports, ends the same way: one line `zerotrain <command>: error:
<message>` on stderr and exit status 2. Nothing here imports torch, so `zerotrain float`
stays quick to start.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, NoReturn

from zerotrain.cli.units import BINARY, DECIMAL

__all__ = [
    "HelpFormatter",
    "Parser",
    "Size",
    "UsageError",
    "command",
    "finite_float",
    "parse_count",
    "parse_size",
    "plot_path",
    "rename_fields",
    "size_help",
    "user_errors",
]

Main = Callable[[list[str]], int]


class UsageError(Exception):
    """A mistake on the command line: reported as one line on stderr, exit status 2."""


class HelpFormatter(argparse.HelpFormatter):
    """Every option with a real default shows it; prose is wrapped, while a paragraph with
    indented lines (examples, tables) is kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        blocks = []
        for block in text.split("\n\n"):
            lines = block.splitlines()
            if any(line.startswith(" ") for line in lines):
                blocks.append("\n".join(indent + line for line in lines))
            else:
                blocks.append(textwrap.fill(" ".join(block.split()), width,
                                            initial_indent=indent, subsequent_indent=indent))
        return "\n\n".join(blocks)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or default is None or default is False:
            return text
        if default is argparse.SUPPRESS:
            return text
        if not action.option_strings and action.nargs not in ("?", "*"):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """`zerotrain <command>`'s parser: its errors raise UsageError instead of exiting."""

    def __init__(self, command: str | None = None, description: str | None = None,
                 **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        if command is not None:  # subparsers pass their own prog
            kwargs.setdefault("prog", f"zerotrain {command}")
        super().__init__(description=description, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")

    def actions(self) -> argparse._SubParsersAction:
        """The ACTION subcommands of a command (`config show`, `tokenizer train`)."""
        return self.add_subparsers(dest="action", metavar="ACTION", required=True)

    def action(self, sub: argparse._SubParsersAction, name: str, summary: str,
               description: str, usage: str) -> argparse.ArgumentParser:
        """One ACTION with the command's prog, formatter and error handling."""
        return sub.add_parser(name, prog=f"{self.prog} {name}", help=summary,
                              formatter_class=self.formatter_class, description=description,
                              usage=usage)


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the user's to fix: reported as one line, never as a traceback.

    Imported only when an error is being reported, so a command that never touches the
    checkpoint code does not pay for importing it (and torch) at start.
    """
    from zerotrain.checkpoint.io import CheckpointError
    from zerotrain.config import ConfigError
    from zerotrain.data.corpus import DataError
    from zerotrain.models.sampling import NonFiniteOutput
    from zerotrain.models.weights import WeightError
    from zerotrain.numerics.scaler import LossScaleError
    from zerotrain.run.setup import Diverged
    from zerotrain.zero.tiers.io import TierError

    return (UsageError, ConfigError, DataError, CheckpointError, LossScaleError, Diverged,
            NonFiniteOutput, WeightError, TierError)


def fail(name: str, message: object) -> int:
    """Print the one error line of `zerotrain <name>` (of `zerotrain` if name is empty);
    returns the exit status 2.

    Under `zerotrain train --nproc N` the ranks hand the line to the launcher instead
    (a file in ZEROTRAIN_ERROR_DIR), which prints it once for the job, not once per rank.
    """
    text = " ".join(str(message).split()) or type(message).__name__
    prog = " ".join(["zerotrain", name]).strip()
    if os.environ.get("ZEROTRAIN_ERROR_DIR") and "RANK" in os.environ:
        from zerotrain.comm.launch import hand_to_launcher

        if hand_to_launcher("error", prog, text):
            return 2
    print(f"{prog}: error: {text}", file=sys.stderr)
    return 2


def command(name: str) -> Callable[[Main], Main]:
    """Turn `main(argv) -> int` into a command: --help exits cleanly, user errors are one
    line with status 2, anything else is a bug and keeps its traceback."""

    def wrap(body: Main) -> Main:
        @functools.wraps(body)
        def run(argv: list[str]) -> int:
            try:
                return body(list(argv))
            except SystemExit as e:  # argparse's --help
                return e.code if isinstance(e.code, int) else 0
            except UsageError as e:  # no import needed to recognise the common case
                return fail(name, e)
            except KeyboardInterrupt:  # Ctrl-C outside the training loop: nothing to save
                if int(os.environ.get("RANK", "0")) == 0:  # said once for a job, not per rank
                    print(f"zerotrain {name}: interrupted", file=sys.stderr)
                return 130
            except Exception as e:
                from zerotrain.run.lifecycle import EXIT_INTERRUPTED, Interrupted

                if isinstance(e, Interrupted):  # saved; rank 0 says so once
                    if int(os.environ.get("RANK", "0")) == 0:
                        print(f"zerotrain {name}: {e}", file=sys.stderr)
                        where = os.environ.get("ZEROTRAIN_ERROR_DIR")
                        if where and "RANK" in os.environ:  # tells the launcher: 75, not 130
                            from zerotrain.comm.launch import SAVED_MARKER

                            Path(where, SAVED_MARKER).write_text(str(e))
                    return EXIT_INTERRUPTED
                if isinstance(e, user_errors()):
                    return fail(name, e)
                if "RANK" in os.environ:  # a rank whose peer died: that peer is the story
                    from zerotrain.comm.launch import peer_gone, torn_down

                    if peer_gone(e):
                        return torn_down(f"zerotrain {name}", e)
                raise

        return run

    return wrap


def rename_fields(message: str, names: dict[str, str]) -> str:
    """Say the user's flag where the library names its own parameter (`warmup_steps` →
    `--warmup`), so a message points at what the user actually typed."""
    if not names:
        return message
    pattern = r"(?<![\w.-])(" + "|".join(re.escape(k) for k in names) + r")(?![\w-])"
    return re.sub(pattern, lambda m: names[m.group(1)], message)


# ---------------------------------------------------------------------- numbers
def finite_float(text: str, flag: str | None = None) -> float:
    """A float that is neither inf nor nan. As argparse's `type=` (no flag) a bad one is
    an ArgumentTypeError, which argparse words with the option's name; given the flag, a
    UsageError that names it."""
    try:
        x = float(text)
    except ValueError:
        problem = f"{text!r} is not a number"
    else:
        if math.isfinite(x):
            return x
        problem = f"must be a finite number, got {text!r}"
    if flag is None:
        raise argparse.ArgumentTypeError(problem)
    raise UsageError(f"{flag} {problem}")


_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_COUNT_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def parse_count(text: str, flag: str, *, minimum: int = 1, limit: int = 10**18) -> int:
    """'7.5e9', '7.5B', '125M', '4k', '2' → a whole count in [minimum, limit]."""
    m = re.fullmatch(r"\s*([-+]?)" + _NUMBER + r"\s*([kKmMbBtT]?)\s*", text)
    if not m:
        raise UsageError(f"{flag} {text!r} is not a count; write a whole number, e.g. 8, "
                         "4k, 125M or 7.5e9")
    x = float(m.group(1) + m.group(2)) * _COUNT_SCALE[m.group(3).lower()]
    if not math.isfinite(x) or x > limit:
        raise UsageError(f"{flag} {text!r} is too large (at most {limit:.0e})")
    n = round(x)
    if abs(x - n) > 1e-9 * max(1.0, abs(x)):  # 7.1B is 7.1 * 1e9 up to rounding
        raise UsageError(f"{flag} must be a whole number, got {text!r}")
    if n < minimum:
        raise UsageError(f"{flag} must be at least {minimum}, got {text!r}")
    return n


class Size(NamedTuple):
    """A byte count, and whether the user spoke in powers of 1024 (so answers can too)."""

    nbytes: int
    binary: bool


# prefix as typed, upper-cased ('G' of '80G' or '80GB', 'GI' of '80GiB') -> bytes
_DECIMAL = {u[0]: f for u, f in DECIMAL.items()}
_BINARY = {u[:2].upper(): f for u, f in BINARY.items()}
_SIZE_LIMIT = 10**21  # a zettabyte: beyond any machine, still far from float overflow


def size_help(bare_unit: str) -> str:
    """The sentence every size option's help ends with."""
    return (f"KB/MB/GB/TB = powers of 1000, KiB/MiB/GiB/TiB = powers of 1024; "
            f"a bare number means {bare_unit}")


def parse_size(text: str, flag: str, *, bare_unit: str) -> Size:
    """'28GB' → 28·10^9, '1.5GiB' → 1.5·2^30, '512 kb' → 512·10^3; a bare number is
    `bare_unit` ('B', 'GB', ...), which each option states in its help.

    GB is 10^9 bytes, as on an accelerator's datasheet; GiB is 2^30.
    """
    m = re.fullmatch(r"\s*" + _NUMBER + r"\s*([A-Za-z]*)\s*", text)
    unit = (m.group(2) if m else "").upper() or bare_unit.upper()
    prefix = unit[:-1] if unit.endswith("B") else unit  # '80G' and '80GB' alike
    factor = 1 if prefix == "" else _DECIMAL.get(prefix) or _BINARY.get(prefix)
    if m is None or factor is None:
        raise UsageError(f"{flag} {text!r} is not a size; write e.g. 28GB, 512MB or 1.5GiB "
                         f"({size_help(bare_unit)})")
    x = float(m.group(1)) * factor
    if not math.isfinite(x) or x > _SIZE_LIMIT:
        raise UsageError(f"{flag} {text!r} is too large (at most 1e21 bytes)")
    nbytes = round(x)
    if nbytes <= 0:
        raise UsageError(f"{flag} must be positive, got {text!r}")
    return Size(nbytes, prefix in _BINARY)


# ---------------------------------------------------------------------- files
def plot_path(text: str, flag: str = "--plot") -> Path:
    """A path matplotlib can write, checked before any work is done."""
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = sorted(FigureCanvasBase.get_supported_filetypes())
    path = Path(text)
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in kinds:
        what = f"matplotlib cannot write .{suffix} files" if suffix else "no file type"
        raise UsageError(f"{flag} {text!r}: {what}; end the name in one of "
                         f"{', '.join('.' + k for k in kinds)}")
    if path.is_dir():
        raise UsageError(f"{flag} {text!r} is a directory; give a file name such as "
                         f"{path / 'plot.png'}")
    return path

