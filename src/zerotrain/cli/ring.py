"""`zerotrain ring`: watch ring all-reduce move chunks, then see what it saves.

The walk-through is symbolic: GPU r starts with chunks a_r, b_r, c_r, … and we replay
`ring_schedule` (the very list of steps `comm/ring.py` executes) on strings, printing
what each GPU holds after every step, while there are letters for the chunks. Then the
traffic of naive schemes versus the ring for a buffer of the given size, for any N; and,
with `--run`, a real check (`ring_check.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from zerotrain.cli.args import Parser, UsageError, command, parse_size, size_help
from zerotrain.cli.units import format_bytes, format_in, pick_unit
from zerotrain.comm.ring import REDUCE_SCATTER, Step, ring_bytes, ring_schedule

MAX_LETTERS = 26  # the tables name chunks A..Z
MAX_RUN = 32  # --run starts this many local processes at most


# ---------------------------------------------------------------------- symbolic replay
@dataclass(frozen=True)
class Snapshot:
    """What every GPU holds after one step: holds[gpu][chunk] = contributing ranks,
    in the order they joined the partial sum (the originating rank first)."""

    title: str
    holds: tuple[tuple[tuple[int, ...], ...], ...]
    updated: frozenset[tuple[int, int]]  # (gpu, chunk) cells written by this step


def _step_title(step: Step, n: int) -> str:
    verb = "adds" if step.phase == REDUCE_SCATTER else "stores"
    moves = ", ".join(f"GPU{t.src}→GPU{t.dst} {chr(65 + t.chunk)}" for t in step.transfers)
    return f"{step.phase} step {step.index + 1}/{n - 1} (receiver {verb}): {moves}"


def symbolic_walkthrough(n: int) -> list[Snapshot]:
    """Replay `ring_schedule(n)` on symbols: the initial state, then one per step.

    Reduce-scatter appends the receiver's own term to the incoming partial sum; the
    all-gather overwrites the receiver's cell with the finished sum.
    """
    holds = [[(r,) for _ in range(n)] for r in range(n)]
    snaps = [Snapshot("initial: GPU r holds its own a_r, b_r, …",
                      tuple(tuple(row) for row in holds), frozenset())]
    for step in ring_schedule(n):
        new = [row[:] for row in holds]
        for t in step.transfers:
            incoming = holds[t.src][t.chunk]  # read the pre-step state: all sends are parallel
            new[t.dst][t.chunk] = (incoming + holds[t.dst][t.chunk]
                                   if step.phase == REDUCE_SCATTER else incoming)
        holds = new
        snaps.append(Snapshot(_step_title(step, n), tuple(tuple(row) for row in holds),
                              frozenset((t.dst, t.chunk) for t in step.transfers)))
    return snaps


def cell_text(chunk: int, ranks: tuple[int, ...]) -> str:
    """(0, (0, 1)) → 'a0+a1'."""
    return "+".join(f"{chr(97 + chunk)}{r}" for r in ranks)


def format_table(snap: Snapshot) -> str:
    n = len(snap.holds)
    cells = [[cell_text(c, snap.holds[g][c]) + ("*" if (g, c) in snap.updated else "")
              for c in range(n)] for g in range(n)]
    width = max(len(x) for row in cells for x in row) + 2
    lines = [("      " + "".join(chr(65 + c).ljust(width) for c in range(n))).rstrip()]
    lines += [f"GPU{g}".ljust(6) + "".join(x.ljust(width) for x in row).rstrip()
              for g, row in enumerate(cells)]
    return "\n".join(lines)


def walkthrough_lines(n: int) -> list[str]:
    """The introduction and, for N ≤ 26, one table per step."""
    if n > MAX_LETTERS:
        return [f"Ring all-reduce over {n} GPUs. Each buffer is split into {n} chunks; every "
                "step each GPU sends one chunk to its right neighbour (r → r+1) and receives "
                "one from its left.",
                f"(The step-by-step tables name each chunk by a letter, so they stop at "
                f"{MAX_LETTERS} GPUs: skipped here. Try --gpus 4 to watch the chunks move.)",
                "", f"After {n - 1} reduce-scatter steps GPU r holds the full sum of chunk "
                f"(r+1) mod {n}; {n - 1} all-gather steps circulate them.", ""]
    out = [f"Ring all-reduce over {n} GPUs. Each buffer is split into {n} chunks "
           f"({', '.join(chr(65 + c) for c in range(n))}); GPU r starts with "
           f"{', '.join(f'{chr(97 + c)}_r' for c in range(n))}.",
           "Each step every GPU sends one chunk to its right neighbour (r → r+1) "
           "and receives one from its left; * marks the cell just updated.", ""]
    for snap in symbolic_walkthrough(n):
        out += [snap.title[0].upper() + snap.title[1:], format_table(snap), ""]
        if snap.title.startswith(f"{REDUCE_SCATTER} step {n - 1}/"):
            owned = ", ".join(f"GPU{r}: {chr(65 + (r + 1) % n)}" for r in range(n))
            out += [f"After reduce-scatter GPU r holds the full sum of chunk (r+1) mod {n} "
                    f"({owned}). Now the all-gather circulates them.", ""]
    out += [f"After all-gather every GPU holds every full sum ({2 * (n - 1)} steps, "
            f"each moving 1/{n} of the buffer).", ""]
    return out


# ---------------------------------------------------------------------- traffic
def busiest_ring_bytes(nbytes: int, n: int) -> int:
    """Bytes sent by the rank that sends most in a ring all-reduce of `nbytes` bytes.

    Chunks 0..extra-1 are one byte larger (`chunk_sizes`); rank extra-1 skips sending
    chunks extra and extra+1, two of the smaller ones (or the smallest pair there is).
    """
    return ring_bytes(nbytes, n, (nbytes % n - 1) % n)[0]


def traffic_lines(n: int, nbytes: int, binary: bool) -> list[str]:
    """Naive schemes vs the ring for a buffer of S bytes, in S's own unit so that they
    compare at a glance (3556.00 GB against 55.56 GB, not 3.56 TB)."""
    unit = pick_unit(nbytes, binary)
    naive = (n - 1) * nbytes
    ring = busiest_ring_bytes(nbytes, n)

    def fb(x: float) -> str:
        return format_in(x, unit)

    unit_note = ("KiB/MiB/GiB = powers of 1024" if binary
                 else "KB/MB/GB = powers of 1000; use KiB/MiB/GiB for 1024")
    return [
        f"Traffic of one all-reduce of S = {fb(nbytes)} ({nbytes:,} bytes; {unit_note}), "
        f"N = {n}:",
        f"  naive all-to-one (N-1)·S    = {fb(naive):>11} on the busiest link (every GPU "
        "sends S to GPU0, which sends the sum back: N-1 buffers in, N-1 out)",
        f"  naive exchange   (N-1)·S    = {fb(naive):>11} sent per rank "
        "(the whole buffer to each of the N-1 others)",
        f"  ring             2(N-1)/N·S = {fb(ring):>11} sent per rank "
        f"(reduce-scatter {format_bytes(ring / 2, binary)} + all-gather "
        f"{format_bytes(ring / 2, binary)})",
        f"  naive / ring = N/2 = {n / 2:.2f}x; the ring never sends more than 2·S "
        "per rank, however many GPUs join (docs/design.md §ring)",
    ]


# ---------------------------------------------------------------------- CLI
def _parser() -> Parser:
    p = Parser("ring", "Walk through ring all-reduce step by step, then compare its traffic "
               "with naive schemes. Background: docs/design.md §ring.")
    p.add_argument("--gpus", type=int, required=True, metavar="N",
                   help=f"ring size N >= 2 (tables up to {MAX_LETTERS}; traffic for any N)")
    p.add_argument("--size", default="28GB",
                   help="buffer for the traffic comparison; 28GB = the fp32 gradients of 7B "
                   f"parameters ({size_help('bytes')})")
    p.add_argument("--run", action="store_true",
                   help=f"also run the ring on N local gloo processes (N <= {MAX_RUN}) and "
                   "compare with dist.all_reduce")
    return p


@command("ring")
def main_ring(argv: list[str]) -> int:
    """Entry point of `zerotrain ring`; returns the process exit status."""
    args = _parser().parse_args(argv)
    n = args.gpus
    if n < 2:
        raise UsageError(f"--gpus must be at least 2 (a ring of one GPU sends nothing), got {n}")
    if args.run and n > MAX_RUN:
        raise UsageError(f"--run starts one process per GPU: use --gpus {MAX_RUN} or fewer")
    size = parse_size(args.size, "--size", bare_unit="B")
    print("\n".join(walkthrough_lines(n) + traffic_lines(n, size.nbytes, size.binary)))
    if args.run:
        from zerotrain.cli.ring_check import run_check

        return 0 if run_check(n) else 1
    return 0
