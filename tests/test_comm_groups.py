"""Collectives over any group: Comm.subgroup / Comm.split, the gradients' own Comm, the
equal-piece all-to-all and its autograd function, and close() destroying every group.

Each spawn runs both algorithms; inputs are integer-valued fp32 (every summation order
exact), so results must equal the single-process reference bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zerotrain.comm.autograd import all_to_all_dims
from zerotrain.comm.collectives import Comm
from zerotrain.comm.lockstep import LockstepError

from multirank import run_ranks


def _data(numel: int, rank: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * salt + rank)
    return torch.randint(-50, 50, (numel,), generator=g).float()


def _subgroup_collectives(sub: Comm) -> dict:
    """One of each collective on `sub`, against the reference built from every member's
    data (regenerated here from the members' global ranks)."""
    m, k, r = sub.world_size, 6, sub.rank
    members = sub.ranks
    x = [_data(k * m, g, 1) for g in members]
    a = x[r].clone()
    sub.all_reduce(a, purpose="grads")
    rs = torch.empty(k)
    sub.reduce_scatter(rs, x[r], purpose="grads")
    ag = torch.empty(k * m)
    sub.all_gather(ag, x[r][:k], purpose="params")
    a2a = torch.empty(k * m)
    sub.all_to_all(a2a, x[r], purpose="sequence", async_op=True).wait()
    total = torch.stack(x).sum(0)
    want_a2a = torch.cat([x[s][r * k:(r + 1) * k] for s in range(m)])
    return {"all_reduce": torch.equal(a, total),
            "reduce_scatter": torch.equal(rs, total[r * k:(r + 1) * k]),
            "all_gather": torch.equal(ag, torch.cat([t[:k] for t in x])),
            "all_to_all": torch.equal(a2a, want_a2a)}


def _uneven_all_to_all(sub: Comm) -> bool:
    """Piece sizes differ by rank pair (Muon's use): s sends 1 + s + d elements to d."""
    m, r = sub.world_size, sub.rank
    ins = [1 + r + d for d in range(m)]
    outs = [1 + s + r for s in range(m)]
    x = torch.arange(sum(ins), dtype=torch.float32) + 1000 * r
    got = torch.empty(sum(outs))
    sub.all_to_all(got, x, outs, ins)
    want = []
    for s in range(m):
        off = sum(1 + s + d for d in range(r))
        want.append(torch.arange(off, off + outs[s], dtype=torch.float32) + 1000 * s)
    return torch.equal(got, torch.cat(want))


def _a2a_autograd(comm: Comm) -> dict:
    """Ulysses' exchange [B, T/N, H, D] -> [B, T, H/N, D] and its gradient, against one
    process doing the same loss over the whole tensor."""
    n, r = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(7)
    b, t, h, d = 2, 4 * n, 2 * n, 3
    x = torch.randn(b, t, h, d, generator=g, dtype=torch.float64)
    w = torch.randn(b, t, h, d, generator=g, dtype=torch.float64)
    seq, heads = slice(r * t // n, (r + 1) * t // n), slice(r * h // n, (r + 1) * h // n)
    shard = x[:, seq].clone().requires_grad_()
    y = all_to_all_dims(comm, shard, scatter_dim=2, gather_dim=1)
    (torch.sin(y) * w[:, :, heads]).sum().backward()
    whole = x.clone().requires_grad_()  # the single-process reference
    (torch.sin(whole) * w).sum().backward()
    back = all_to_all_dims(comm, y.detach(), scatter_dim=1, gather_dim=2)
    return {"forward": torch.equal(y.detach(), x[:, :, heads]),
            "backward": torch.allclose(shard.grad, whole.grad[:, seq], rtol=0, atol=1e-12),
            "round_trip": torch.equal(back, x[:, seq])}


def _lockstep_in_subgroup(sub: Comm) -> str:
    """The second group's last rank asks for a different size."""
    odd = sub.ranks[0] != 0 and sub.rank == sub.world_size - 1
    k = 5 if odd else 4
    try:
        sub.all_gather(torch.empty(k * sub.world_size), torch.ones(k))
    except LockstepError as e:
        return f"LockstepError: {e}"
    return "ok"


def _groups(algo: str) -> dict:
    from torch.distributed import distributed_c10d as c10d

    n = dist.get_world_size()
    comm = Comm(algo, check_lockstep=True, grad_group=True)
    half = comm.split(n // 2)
    pair = comm.subgroup([1, n - 1])  # None outside; made after split: same order everywhere
    if n > 2:
        with pytest.raises(ValueError, match="every rank"):
            half.subgroup([0])
    res: dict = {"half": (half.ranks, half.rank, half.world_size),
                 "pair": None if pair is None else (pair.ranks, pair.rank),
                 "shared": (half.counter is comm.counter, half.device == comm.device,
                            half.lockstep is not None and half.lockstep is not comm.lockstep,
                            comm.grads is not comm,
                            comm.grads.lockstep is comm.lockstep)}
    comm.counter.reset()
    res["sub"] = _subgroup_collectives(half)
    res["counts"] = comm.counter.snapshot()
    res["uneven"] = _uneven_all_to_all(half)
    res["pair_ok"] = None if pair is None else _subgroup_collectives(pair)
    res["autograd_world"] = _a2a_autograd(comm)
    res["autograd_half"] = _a2a_autograd(half)
    res["lockstep"] = _lockstep_in_subgroup(half)
    x = torch.ones(3)
    comm.grads.all_reduce(x)  # the parent and its gradients' Comm still work afterwards
    comm.all_reduce(x, purpose="other")
    res["after"] = x.tolist()
    made = [g for c in (comm, comm.grads, half, pair) if c is not None
            for g in (c.group, c._ring_group) if g is not None]
    before = [g in c10d._world.pg_map for g in made]
    comm.close()
    comm.close()  # idempotent
    res["closed"] = (before, [g in c10d._world.pg_map for g in made],
                     len(c10d._world.pg_map), comm.grads is comm)
    with pytest.raises(ValueError, match="does not divide"):
        comm.split(3)
    return res


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"N{n}")
def world(request) -> tuple[int, list[dict]]:
    n = request.param
    return n, run_ranks(_both, n)


def _both() -> dict:
    return {algo: _groups(algo) for algo in ("native", "ring")}


@pytest.mark.parametrize("algo", ["native", "ring"])
def test_split_and_subgroup_membership(world, algo):
    n, ranks = world
    s = n // 2
    for r, res in enumerate(ranks):
        res = res[algo]
        first = r // s * s
        assert res["half"] == (list(range(first, first + s)), r - first, s)
        pair = sorted({1, n - 1})
        assert res["pair"] == (None if r not in pair else (pair, pair.index(r)))
        assert res["shared"] == (True, True, s > 1, True, True)


@pytest.mark.parametrize("algo", ["native", "ring"])
def test_subgroup_collectives_equal_the_reference(world, algo):
    n, ranks = world
    for r, res in enumerate(ranks):
        res = res[algo]
        assert all(res["sub"].values()), (r, res["sub"])
        assert res["uneven"], r
        if r in (1, n - 1) and n > 2:
            assert all(res["pair_ok"].values()), (r, res["pair_ok"])
        assert res["after"] == [float(n * n)] * 3


@pytest.mark.parametrize("algo", ["native", "ring"])
def test_subgroup_bytes_equal_theory(world, algo):
    """At m ranks with equal chunks: all-reduce 2(m-1)/m of the buffer, reduce-scatter
    and all-to-all (m-1)/m of their input, all-gather (m-1)/m of its output — observed
    by the ring, computed for native."""
    n, ranks = world
    m, k = n // 2, 6
    if m == 1:  # a group of one moves nothing
        assert all(res[algo]["counts"] == {} for res in ranks)
        return
    f, buf = (m - 1) / m, 4 * k * m
    how = "observed" if algo == "ring" else "computed"

    def entry(moved: float) -> dict:
        return {"calls": 1, "sent_bytes": int(moved), "recv_bytes": int(moved), "how": how,
                "inter_sent_bytes": 0, "inter_recv_bytes": 0}  # one node

    want = {"grads": {"all_reduce": entry(2 * f * buf), "reduce_scatter": entry(f * buf)},
            "params": {"all_gather": entry(f * buf)},
            "sequence": {"all_to_all": entry(f * buf)}}
    for res in ranks:
        assert res[algo]["counts"] == want


@pytest.mark.parametrize("algo", ["native", "ring"])
def test_all_to_all_autograd_matches_one_process(world, algo):
    for r, res in enumerate(ranks_of(world, algo)):
        want = {"forward": True, "backward": True, "round_trip": True}
        assert res["autograd_world"] == want, r
        assert res["autograd_half"] == want, r


def ranks_of(world, algo):
    return [res[algo] for res in world[1]]


@pytest.mark.parametrize("algo", ["native", "ring"])
def test_lockstep_catches_a_mismatch_inside_a_subgroup(world, algo):
    n, ranks = world
    s = n // 2
    for r, res in enumerate(ranks):
        msg = res[algo]["lockstep"]
        if s == 1:  # a group of one checks nothing
            assert msg == "ok", (r, msg)
        else:  # split groups are checked in the world's one sequence (H-2): every rank
            # hears of the last rank's other size, named with its group
            assert msg.startswith("LockstepError"), (r, msg)
            assert f"rank(s) {n - 1} differ" in msg, msg
            assert f"params on the {s}-rank split groups" in msg, msg


@pytest.mark.parametrize("algo", ["native", "ring"])
def test_close_destroys_every_group(world, algo):
    for res in ranks_of(world, algo):
        before, after, left, grads_reset = res["closed"]
        assert before and all(before) and not any(after)
        assert left == 1 and grads_reset  # only the default group remains


def test_subgroup_needs_the_whole_world_and_ranks_inside_it():
    comm = Comm("native")  # no process group: a world of one
    assert comm.subgroup([0]).world_size == 1
    with pytest.raises(ValueError, match="not within"):
        comm.subgroup([1])
    assert comm.split(1).world_size == 1
