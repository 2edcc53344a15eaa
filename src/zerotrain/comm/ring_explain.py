"""`zerotrain ring`: watch ring all-reduce move chunks, then see what it saves.

The walk-through is symbolic: GPU r starts with chunks a_r, b_r, c_r, … and we replay
`ring_schedule` (the very list of steps `ring.py` executes) on strings, printing what
each GPU holds after every step. Then the per-rank traffic of a naive exchange versus
the ring for a buffer of the given size, and, with `--run`, a real check: N local gloo
processes started by torchrun's own machinery (`elastic_launch`) compare the ring
against `dist.all_reduce`.
"""

from __future__ import annotations

import argparse
import re
import sys
import uuid
from dataclasses import dataclass

from zerotrain.comm.ring import (
    REDUCE_SCATTER,
    Step,
    chunk_sizes,
    ring_schedule,
)

MAX_GPUS = 26  # one letter per chunk

_DECIMAL = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_BINARY = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class UsageError(ValueError):
    """Bad command-line input: reported as one line on stderr, exit status 2."""


# ---------------------------------------------------------------------- sizes
def parse_size(text: str) -> tuple[int, bool]:
    """'28GB' → (28·10^9, False); '1.5GiB' → (1.5·2^30, True). Bare numbers are bytes.

    Returns the byte count and whether the user spoke in binary units, so the report
    answers in the same family (GB is 10^9 bytes here, as on a GPU's datasheet).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    factor = _DECIMAL.get(unit or "B") or _BINARY.get(unit)
    if m is None or factor is None:
        raise UsageError(
            f"--size {text!r} is not a size; write e.g. 28GB, 512MB or 1.5GiB "
            "(B/KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024)")
    nbytes = round(float(m.group(1)) * factor)
    if nbytes <= 0:
        raise UsageError(f"--size must be positive, got {text!r}")
    return nbytes, unit in _BINARY


def format_bytes(n: float, binary: bool = False) -> str:
    """Human size in the decimal (GB = 10^9) or binary (GiB = 2^30) family."""
    base, units = (1024, ["B", "KiB", "MiB", "GiB", "TiB"]) if binary else (
        1000, ["B", "KB", "MB", "GB", "TB"])
    i = 0
    while abs(n) >= base and i < len(units) - 1:
        n /= base
        i += 1
    return f"{n:.0f} B" if i == 0 else f"{n:.2f} {units[i]}"


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


# ---------------------------------------------------------------------- traffic
def traffic_lines(n: int, nbytes: int, binary: bool) -> list[str]:
    """Per-rank bytes sent: naive exchange vs the ring, for a buffer of S bytes."""
    naive = (n - 1) * nbytes
    ring = 2 * (n - 1) / n * nbytes

    def fb(x: float) -> str:
        return format_bytes(x, binary)

    unit_note = ("KiB/MiB/GiB = powers of 1024" if binary
                 else "KB/MB/GB = powers of 1000; use KiB/MiB/GiB for 1024")
    return [
        f"Per-rank traffic for an all-reduce of S = {fb(nbytes)} ({nbytes:,} bytes; "
        f"{unit_note}), N = {n}:",
        f"  naive exchange  (N-1)·S     = {fb(naive):>11} sent per rank "
        "(the whole buffer to each of the N-1 others)",
        f"  ring            2(N-1)/N·S  = {fb(ring):>11} sent per rank "
        f"(reduce-scatter {fb(ring / 2)} + all-gather {fb(ring / 2)})",
        f"  naive / ring = N/2 = {naive / ring:.2f}x; the ring never sends more than 2·S "
        "per rank, however many GPUs join",
    ]


# ---------------------------------------------------------------------- --run
def _run_worker(numel: int, seed: int) -> dict:
    """One torchrun-launched rank: ring_all_reduce vs dist.all_reduce on the same data.

    Module level so elastic_launch's spawned children can import it.
    """
    import torch
    import torch.distributed as dist

    from zerotrain.comm.ring import ring_all_reduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        g = torch.Generator().manual_seed(seed + rank)
        mine = torch.randn(numel, generator=g)
        native = mine.clone()
        dist.all_reduce(native)
        sent, recv = ring_all_reduce(mine)
        diff = (mine - native).abs().max().item() if numel else 0.0
        return {"rank": rank, "max_abs_diff": diff, "sent": sent, "recv": recv}
    finally:
        dist.destroy_process_group()


def run_check(n: int, numel: int = 10_007, seed: int = 1234, tol: float = 1e-5) -> bool:
    """Launch N local gloo ranks the way torchrun --standalone does, then report."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
        start_method="spawn",
    )
    print(f"\n--run: {n} local gloo processes via torch.distributed elastic_launch, "
          f"{numel} fp32 elements each (not divisible by {n}; seeded randn)")
    try:
        results = elastic_launch(config, _run_worker)(numel, seed)
    except Exception as e:  # ChildFailedError and friends: say so, do not dump a trace
        print(f"  FAILED: the launched ranks did not complete: {e}", file=sys.stderr)
        return False
    sizes = [4 * c for c in chunk_sizes(numel, n)]
    total = 4 * numel
    ok = True
    for local_rank in sorted(results):
        res = results[local_rank]
        r = res["rank"]
        # rank r sends every chunk but (r+1) in reduce-scatter and every chunk but (r+2)
        # in all-gather: 2(N-1)/N·S, exact for these uneven chunk sizes
        expect_sent = 2 * total - sizes[(r + 1) % n] - sizes[(r + 2) % n]
        expect_recv = 2 * total - sizes[r] - sizes[(r + 1) % n]
        good = (res["max_abs_diff"] <= tol and res["sent"] == expect_sent
                and res["recv"] == expect_recv)
        ok &= good
        print(f"  rank {r}: max |ring - dist.all_reduce| = {res['max_abs_diff']:.2e} "
              f"(tol {tol:g}); sent {res['sent']:,} B (expected {expect_sent:,}), "
              f"received {res['recv']:,} B (expected {expect_recv:,})  "
              f"{'ok' if good else 'MISMATCH'}")
    print(f"  2(N-1)/N·S = {2 * (n - 1) / n * total:,.1f} B for S = {total:,} B")
    print("  PASS: ring all-reduce equals dist.all_reduce" if ok else "  FAIL")
    return ok


# ---------------------------------------------------------------------- CLI
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zerotrain ring",
                description="Walk through ring all-reduce (SPEC §5) step by step.")
    p.add_argument("--gpus", type=int, required=True, help=f"ring size N, 2..{MAX_GPUS}")
    p.add_argument("--size", default="28GB",
                   help="buffer size for the traffic comparison, e.g. 28GB (10^9) or "
                        "26GiB (2^30); default 28GB = fp32 gradients of 7B parameters")
    p.add_argument("--run", action="store_true",
                   help="also run the ring on N local gloo processes and compare with "
                        "dist.all_reduce")
    return p


def main_ring(argv: list[str]) -> int:
    """Entry point of `zerotrain ring`; returns the process exit status."""
    try:
        args = _parser().parse_args(argv)
        if not 2 <= args.gpus <= MAX_GPUS:
            raise UsageError(f"--gpus must be between 2 and {MAX_GPUS}, got {args.gpus}")
        nbytes, binary = parse_size(args.size)
    except UsageError as e:
        print(f"zerotrain ring: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)

    n = args.gpus
    print(f"Ring all-reduce over {n} GPUs. Each buffer is split into {n} chunks "
          f"({', '.join(chr(65 + c) for c in range(n))}); GPU r starts with "
          f"{', '.join(f'{chr(97 + c)}_r' for c in range(n))}.")
    print("Each step every GPU sends one chunk to its right neighbour (r → r+1) "
          "and receives one from its left; * marks the cell just updated.\n")
    for snap in symbolic_walkthrough(n):
        print(snap.title[0].upper() + snap.title[1:])
        print(format_table(snap))
        print()
        if snap.title.startswith(f"{REDUCE_SCATTER} step {n - 1}/"):
            owned = ", ".join(f"GPU{r}: {chr(65 + (r + 1) % n)}" for r in range(n))
            print(f"After reduce-scatter GPU r holds the full sum of chunk (r+1) mod {n} "
                  f"({owned}). Now the all-gather circulates them.\n")
    print(f"After all-gather every GPU holds every full sum ({2 * (n - 1)} steps, "
          f"each moving 1/{n} of the buffer).\n")
    print("\n".join(traffic_lines(n, nbytes, binary)))
    if args.run:
        return 0 if run_check(n) else 1
    return 0
