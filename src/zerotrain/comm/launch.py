"""`zerotrain train --nproc N`: start N local ranks with torchrun's own machinery.

We hand torchrun (`torch.distributed.run`) the same command line minus our launcher
flags, as `python -m zerotrain ...`, in standalone mode (a local rendezvous on a free
port). For several machines, call torchrun yourself — `torchrun --nnodes 2
--nproc-per-node 8 --rdzv-endpoint HOST:PORT -m zerotrain train ...` — nothing here
changes.

What the launcher adds:
- the job's outcome in one line: the failing rank's own error, or the signal that killed
  it. Every rank that stops hands the launcher a note (`hand_to_launcher`, a file in
  ZEROTRAIN_ERROR_DIR): its own error (a root cause), or "torn down by a peer" (its
  collective broke because another rank died, `peer_gone`) — such a rank prints nothing.
  The line names a root cause whenever one exists (`choose_cause`), never a victim,
  whatever order the processes ended in;
- ranks that die with it (see `lifecycle.die_with_parent`);
- restarts through torchrun's elastic agent (`--max-restarts K`), each announced in one
  line ("restarting (1 of 3)"); a rank's own error (a user error) is not retried, as it
  would only repeat;
- Ctrl-C / SIGTERM: the ranks finish their step and save; a second one aborts at once;
- torchrun's own log lines are silenced: they would bury ours.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

EXIT_INTERRUPTED = 75  # the same status as zerotrain.run.lifecycle.EXIT_INTERRUPTED
EXIT_NOT_SAVED = 130  # interrupted before anything was saved (as a shell's Ctrl-C)
#: rank 0's note that an interrupted run saved its checkpoint (written by cli.args)
SAVED_MARKER = "interrupted-saved.txt"
ERROR_DIR = "ZEROTRAIN_ERROR_DIR"

#: What a collective or store raises on a rank whose peer process is gone (gloo, NCCL,
#: the TCP store): that rank is a victim, not the cause.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "Connection refused", "failed to recv, got 0 bytes", "remote process exited",
             "NCCL communicator was aborted", "ncclRemoteError", "ProcessGroupNCCL is aborted")


def describe_exit(code: int) -> str:
    """'exit code 2', or 'killed by signal 9 (SIGKILL)' for a negative status."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-code} ({name})"
    return f"exit code {code}"


# ------------------------------------------------------------------ the ranks' side
def under_launcher() -> bool:
    """True in a rank started by `launch_local` (its notes reach the launcher)."""
    return bool(os.environ.get(ERROR_DIR)) and "RANK" in os.environ


def hand_to_launcher(kind: str, prog: str, message: str) -> bool:
    """Leave this rank's outcome for the launcher: kind "error" (its own error, a root
    cause) or "peer" (torn down because another rank died). False when no launcher of
    ours is listening (one process, or plain torchrun): the caller prints instead."""
    if not under_launcher():
        return False
    rank = int(os.environ["RANK"])
    note = {"kind": kind, "prog": prog, "message": message, "time": time.time(),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    path = Path(os.environ[ERROR_DIR], f"rank{rank}.json")
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(note))
        tmp.replace(path)  # never a half-written note
    except OSError:
        return False
    return True


def peer_gone(exc: BaseException) -> bool:
    """Did this exception come from a peer process that went away (not from this rank)?"""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (RuntimeError, OSError)) and any(s in str(e) for s in PEER_GONE):
            return True
        e = e.__cause__ or e.__context__
    return False


def torn_down(prog: str, exc: BaseException) -> int:
    """A rank whose collective broke because a peer died: no traceback (the peer's own
    error is the story). Under our launcher it says nothing; under plain torchrun, one
    line. Returns the exit status."""
    rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if not hand_to_launcher("peer", prog, first):
        print(f"{prog}: rank {rank} of {world} stopped: another rank closed its connection "
              "(that rank's own error is the cause)", file=sys.stderr)
    return 1


# ------------------------------------------------------------------ the launcher's side
@dataclass
class Outcome:
    """How one rank ended, as the launcher understands it."""

    rank: int
    code: int        # exit status (negative: killed by that signal)
    kind: str        # "error", "crash", "interrupted", "stopped", "peer"
    text: str        # what to print about it
    time: float      # when (precise for the ranks' own notes; torchrun's: whole seconds)

    #: the order in which outcomes are causes: a rank's own error first, then a crash
    #: (a bug's traceback, or a kill from outside), last the ranks the launcher stopped
    #: or whose peers vanished
    ORDER = ("error", "crash", "interrupted", "stopped", "peer")

    def key(self) -> tuple[int, float, int]:
        return (self.ORDER.index(self.kind), self.time, self.rank)


def _note(errors: Path, rank: int) -> dict[str, Any] | None:
    try:
        note = json.loads((errors / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) else None


def _torch_message(failure: Any) -> str:
    msg = failure.message.get("message", "") if isinstance(failure.message, dict) else \
        str(failure.message or "")
    return msg.strip().splitlines()[-1] if msg.strip() else ""


def outcomes(failures: Mapping[int, Any], errors: Path) -> list[Outcome]:
    """Each failed rank's outcome, from its note (if it left one) and torchrun's record."""
    out = []
    for rank, f in failures.items():
        code = f.exitcode if isinstance(f.exitcode, int) else 1
        note = _note(errors, rank)
        when = float(getattr(f, "timestamp", 0) or 0)
        if note is not None and note.get("kind") in ("error", "peer"):
            text = f"{note.get('prog', 'zerotrain')}: error: {note.get('message', '')}" \
                if note["kind"] == "error" else str(note.get("message", ""))
            out.append(Outcome(rank, code, note["kind"], text, float(note.get("time", when))))
            continue
        msg = _torch_message(f)
        if code == EXIT_INTERRUPTED:
            kind = "interrupted"
        elif msg and any(s in msg for s in PEER_GONE):
            kind = "peer"  # a rank that died of its peer without our handler (e.g. a bug)
        elif code in (-signal.SIGTERM, -signal.SIGINT):
            kind = "stopped"  # most often the agent's own SIGTERM after another rank failed
        else:
            kind = "crash"
        if not msg or msg.startswith("Signal ") or msg.startswith("To enable traceback"):
            msg = "its output is shown above" if code > 0 else ""  # a signal says it all
        out.append(Outcome(rank, code, kind, msg, when))
    return out


def choose_cause(found: list[Outcome], nproc: int) -> tuple[Outcome, str]:
    """The root cause among the outcomes, and the one line that tells it."""
    cause = min(found, key=Outcome.key)
    if cause.kind == "error":
        mine = [o for o in found if o.kind == "error"]
        same = len(mine) == nproc and len({o.text for o in mine}) == 1
        if same or nproc == 1:  # every rank said it: nothing rank-specific to add
            return cause, cause.text
        head, sep, rest = cause.text.partition(": error: ")
        return cause, f"{head}{sep}rank {cause.rank} of {nproc}: {rest}"
    detail = f": {cause.text}" if cause.text else ""
    return cause, (f"zerotrain: rank {cause.rank} of {nproc} failed "
                   f"({describe_exit(cause.code)}){detail}")


def _report(failures: Mapping[int, Any], nproc: int, errors: Path) -> int:
    found = outcomes(failures, errors)
    cause, line = choose_cause(found, nproc)
    if cause.kind in ("interrupted", "stopped", "peer") and any(
            o.kind == "interrupted" for o in found):
        return EXIT_INTERRUPTED  # interrupted and saved: rank 0 has said so
    print(line, file=sys.stderr, flush=True)
    return cause.code if cause.code > 0 else 1


class Aborted(Exception):
    """A second Ctrl-C / SIGTERM while the ranks were saving: they were killed."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _our_agent(nproc: int, errors: Path) -> Iterator[None]:
    """torchrun's local agent, with our reporting of restarts and of a second signal.

    `launch_agent` builds its agent from the module's `LocalElasticAgent`; we swap in a
    subclass for the duration of the call (two hooks; without them — another torch —
    the job still runs, only these two messages are missing)."""
    import torch.distributed.launcher.api as api

    base = api.LocalElasticAgent

    class Agent(base):  # type: ignore[misc, valid-type]
        _stopping = False

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            left = getattr(self, "_remaining_restarts", 0)
            if result.is_failed() and left > 0:
                found = outcomes(result.failures, errors)
                cause, line = choose_cause(found, nproc)
                if cause.kind == "error":  # the user's to fix: a restart would repeat it
                    self._remaining_restarts = 0
                else:
                    total = worker_group.spec.max_restarts
                    print(f"{line}; restarting ({total - left + 1} of {total}) from the last "
                          "complete checkpoint", file=sys.stderr, flush=True)
                    for f in errors.glob("rank*.json"):  # the next attempt's notes only
                        f.unlink(missing_ok=True)
            return result

        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM,
                      *args: Any, **kwargs: Any) -> None:
            if not isinstance(sys.exc_info()[1], SignalException) or self._stopping:
                return super()._shutdown(death_sig, *args, **kwargs)
            self._stopping = True  # the user's stop: the ranks finish their step and save
            if death_sig == signal.SIGINT:
                print("\nzerotrain: stopping after this step to save a checkpoint; press "
                      "Ctrl-C again to abort without saving", file=sys.stderr, flush=True)
            try:
                super()._shutdown(death_sig, *args, **kwargs)
            except SignalException as e:  # a second signal while they save: abort now
                super()._shutdown(signal.SIGKILL, 5)
                raise Aborted(int(e.sigval)) from None

    api.LocalElasticAgent = Agent
    try:
        yield
    finally:
        api.LocalElasticAgent = base


def interrupted_status(errors: Path) -> int:
    """The job's status after Ctrl-C/SIGTERM: 75 promises a checkpoint, so only when rank 0
    left word that it saved one (a stop during start-up or before the first step saved
    nothing: 130, as a shell reports Ctrl-C)."""
    return EXIT_INTERRUPTED if (errors / SAVED_MARKER).exists() else EXIT_NOT_SAVED


def not_saved_line(signum: int) -> str:
    """The launcher's line for a stop that saved nothing (during start-up, before the
    first step ended, or ranks of a script that saves nothing on a signal)."""
    what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    return (f"zerotrain: stopped by {what}; this stop saved no checkpoint (it came before "
            "the ranks could save one, or the script saves none on a signal): the last "
            "complete checkpoint, if any, is where to continue")


def quiet_when_peer_gone() -> None:
    """In a rank of `zerotrain launch`: an exception that only says another rank went
    away (gloo's "Connection reset by peer" after a kill) ends the rank without a
    traceback — the launcher names the rank that failed; other exceptions print as
    always."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        if peer_gone(exc):
            code = torn_down(Path(sys.argv[0]).name or "script", exc)
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)  # not the exit handlers: their barriers would wait on the dead
        previous(kind, exc, tb)
    sys.excepthook = hook


def _quiet_torchrun() -> None:
    """torchrun's log lines (one per signal, restart or failed rank: "E1201 ... failed
    (exitcode: 2)") would bury ours; its loggers take their level from LOGLEVEL when
    created. A user who sets LOGLEVEL gets what they asked for."""
    os.environ.setdefault("LOGLEVEL", "CRITICAL")
    level = os.environ["LOGLEVEL"]
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run",
                            "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(level)


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
    _quiet_torchrun()
    args = torchrun.get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
         *(["--module", module] if module else []), *argv]
    )
    with tempfile.TemporaryDirectory(prefix="zerotrain-errors-") as errors:
        os.environ[ERROR_DIR] = errors
        try:
            with _our_agent(nproc, Path(errors)):
                torchrun.run(args)
        except ChildFailedError as e:
            return _report(e.failures, nproc, Path(errors))
        except Aborted as e:
            what = "Ctrl-C" if e.signum == signal.SIGINT else signal.Signals(e.signum).name
            print(f"zerotrain: aborted by a second {what}: the ranks were stopped without "
                  "saving; --resume continues from the last complete checkpoint",
                  file=sys.stderr, flush=True)
            return 128 + e.signum
        except SignalException as e:  # Ctrl-C / SIGTERM: the ranks were told to save and stop
            status = interrupted_status(Path(errors))
            if status == EXIT_NOT_SAVED:  # say so: the stop's only line must not promise one
                print(not_saved_line(int(e.sigval)), file=sys.stderr, flush=True)
            return status
        finally:
            os.environ.pop(ERROR_DIR, None)
    return 0

