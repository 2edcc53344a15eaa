"""`zerotrain train --nproc N`: start N local ranks with torchrun's own machinery.

We hand torchrun (`torch.distributed.run`) the same command line minus our launcher
flags, as `python -m zerotrain ...`, in standalone mode (a local rendezvous on a free
port). For several machines, call torchrun yourself — `torchrun --nnodes 2
--nproc-per-node 8 --rdzv-endpoint HOST:PORT -m zerotrain train ...` — nothing here
changes.

What the launcher adds: the job's outcome in one line (a rank's own error, or the signal
that killed it), ranks that die with it (see `lifecycle.die_with_parent`), restarts
through torchrun's elastic agent (`--max-restarts K`), and a quiet exit when the job was
interrupted and saved.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

EXIT_INTERRUPTED = 75  # the same status as zerotrain.lifecycle.EXIT_INTERRUPTED


def describe_exit(code: int) -> str:
    """'exit code 2', or 'killed by signal 9 (SIGKILL)' for a negative status."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-code} ({name})"
    return f"exit code {code}"


def _report(e: ChildFailedError, nproc: int, errors: Path) -> int:
    rank, f = e.get_first_failure()  # earliest: the root cause, not its victims
    code = f.exitcode if isinstance(f.exitcode, int) else 1
    if code == EXIT_INTERRUPTED:  # interrupted and saved: rank 0 has said so
        return code
    own = errors / f"rank{rank}.txt"
    if own.is_file():  # the rank's own one-line error (a user error)
        print(own.read_text().strip(), file=sys.stderr)
        return code
    msg = f.message.get("message", "") if isinstance(f.message, dict) else ""
    detail = msg.strip().splitlines()[-1] if msg.strip() else (
        "its output is shown above" if code > 0 else "it printed nothing")
    print(f"zerotrain: rank {rank} of {nproc} failed ({describe_exit(code)}): {detail}",
          file=sys.stderr)
    return code if code > 0 else 1


def launch_local(nproc: int, argv: list[str], module: str | None = "zerotrain",
                 max_restarts: int = 0) -> int:
    """Run `python -m <module> <argv>` on `nproc` local ranks (module None: `python
    <argv>`, argv[0] being a script); non-zero if the job fails."""
    from torch.distributed import run as torchrun

    cores = os.cpu_count() or 1
    if nproc > cores:
        print(f"zerotrain: warning: {nproc} ranks on {cores} CPU cores; each rank gets one "
              "thread and they will compete for the cores", file=sys.stderr)
    # Split the cores between ranks (torchrun would otherwise force 1 thread and warn).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    os.environ["ZEROTRAIN_LAUNCHER_PID"] = str(os.getpid())
    # torchrun's own log lines (one per signal or restart) would bury ours; its loggers
    # take their level from LOGLEVEL when created
    os.environ.setdefault("LOGLEVEL", "ERROR")
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    args = torchrun.get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
         *(["--module", module] if module else []), *argv]
    )
    with tempfile.TemporaryDirectory(prefix="zerotrain-errors-") as errors:
        os.environ["ZEROTRAIN_ERROR_DIR"] = errors
        try:
            torchrun.run(args)
        except ChildFailedError as e:
            return _report(e, nproc, Path(errors))
        except SignalException:  # Ctrl-C / SIGTERM: the ranks were told to save and stop
            return EXIT_INTERRUPTED
        finally:
            os.environ.pop("ZEROTRAIN_ERROR_DIR", None)
    return 0
