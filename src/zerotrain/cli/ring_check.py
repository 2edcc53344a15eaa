"""`zerotrain ring --run`: the ring against `dist.all_reduce` on N real local processes.

The ranks are started by torchrun's own machinery (`elastic_launch`), as `torchrun
--standalone` would; each reports its largest difference from the native result and the
bytes it handed to isend/irecv, which must equal `ring_bytes` exactly.
"""

from __future__ import annotations

import sys
import uuid

from zerotrain.comm.ring import ring_bytes


def _run_worker(numel: int, seed: int) -> dict:
    """One launched rank: ring_all_reduce vs dist.all_reduce on the same data.

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
    ok = True
    for local_rank in sorted(results):
        res = results[local_rank]
        r = res["rank"]
        expect_sent, expect_recv = ring_bytes(numel, n, r, element_size=4)
        good = (res["max_abs_diff"] <= tol and res["sent"] == expect_sent
                and res["recv"] == expect_recv)
        ok &= good
        print(f"  rank {r}: max |ring - dist.all_reduce| = {res['max_abs_diff']:.2e} "
              f"(tol {tol:g}); sent {res['sent']:,} B (expected {expect_sent:,}), "
              f"received {res['recv']:,} B (expected {expect_recv:,})  "
              f"{'ok' if good else 'MISMATCH'}")
    print(f"  2(N-1)/N·S = {2 * (n - 1) / n * 4 * numel:,.1f} B for S = {4 * numel:,} B")
    print("  PASS: ring all-reduce equals dist.all_reduce" if ok else "  FAIL")
    return ok
