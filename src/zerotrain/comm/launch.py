"""`zerotrain train --nproc N`: start N local ranks with torchrun's own machinery.

We hand torchrun (`torch.distributed.run`) the same command line minus `--nproc`, as
`python -m zerotrain ...`, in standalone mode (a local rendezvous on a free port). For
several machines, call torchrun yourself — `torchrun --nnodes 2 --nproc-per-node 8
--rdzv-endpoint HOST:PORT -m zerotrain train ...` — nothing here changes.
"""

from __future__ import annotations

import os
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError


def launch_local(nproc: int, argv: list[str], module: str = "zerotrain") -> int:
    """Run `python -m <module> <argv>` on `nproc` local ranks; non-zero if any rank fails."""
    from torch.distributed import run as torchrun

    if nproc < 1:
        print(f"zerotrain: error: --nproc must be >= 1, got {nproc}", file=sys.stderr)
        return 2
    # Split the cores between ranks (torchrun would otherwise force 1 thread and warn).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    args = torchrun.get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
         "--module", module, *argv]
    )
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        rank, f = e.get_first_failure()  # earliest: the root cause, not its victims
        msg = f.message.get("message", "") if isinstance(f.message, dict) else ""
        detail = msg.strip().splitlines()[-1] if msg.strip() else "its output is shown above"
        print(f"zerotrain: rank {rank} of {nproc} failed (exit code {f.exitcode}): {detail}",
              file=sys.stderr)
        return f.exitcode if isinstance(f.exitcode, int) and f.exitcode > 0 else 1
    return 0
