"""The Comm facade: native and ring give the same answers, sync or async, and count bytes.

Inputs are integer-valued fp32, so every summation order is exact and results must be
identical to torch.distributed's own collectives bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zerotrain.comm.collectives import Comm

from multirank import run_ranks


def _data(numel: int, rank: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * salt + rank)
    return torch.randint(-50, 50, (numel,), generator=g).float()


def _native_rs(out, inp):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp)


def _native_ag(out, inp):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp)


def _ref_all_reduce(x):
    y = x.clone()
    dist.all_reduce(y)
    return y


def _ref_rs(x, m):
    y = torch.empty(m)
    _native_rs(y, x.clone())
    return y


def _ref_ag(x, n):
    y = torch.empty(n * x.numel())
    _native_ag(y, x)
    return y


def _facade_checks() -> dict:
    """Both algorithms, sync and async, in one spawn; returns flags and counter snapshots."""
    r, n = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    for algo in ("native", "ring"):
        comm = Comm(algo)
        res: dict = {}
        # ---- synchronous: one of each, sizes not divisible by N
        x, inp, y = _data(7 * n + 3, r, 1), _data(5 * n, r, 2), _data(5, r, 3)
        want = (_ref_all_reduce(x), _ref_rs(inp, 5), _ref_ag(y, n))
        a, o, g = x.clone(), torch.empty(5), torch.empty(5 * n)
        comm.all_reduce(a)
        comm.reduce_scatter(o, inp)
        comm.all_gather(g, y)
        res["sync"] = [torch.equal(a, want[0]), torch.equal(o, want[1]),
                       torch.equal(g, want[2])]
        res["sync_counts"] = comm.counter.snapshot()
        comm.counter.reset()

        # ---- asynchronous: five in flight, a control reduction meanwhile, waited in reverse
        xs = [_data(k * n + 1, r, 10 + k) for k in range(1, 4)]
        shard_in = _data(4 * n, r, 20)
        gath_in = _data(4, r, 21)
        want_x = [_ref_all_reduce(t) for t in xs]
        want_rs, want_ag = _ref_rs(shard_in, 4), _ref_ag(gath_in, n)
        work = [t.clone() for t in xs]
        # in-place ZeRO-1 style: output is this rank's own chunk of the input
        shard_buf = shard_in.clone()
        shard = shard_buf[r * 4:(r + 1) * 4]
        gathered = torch.zeros(4 * n)
        handles = [comm.all_reduce(work[0], async_op=True),
                   comm.reduce_scatter(shard, shard_buf, async_op=True),
                   comm.all_reduce(work[1], purpose="params", async_op=True),
                   comm.all_gather(gathered, gath_in, async_op=True),
                   comm.all_reduce(work[2], async_op=True)]
        scal = comm.all_reduce_scalars([1.0, float(r)])
        ctl = torch.tensor([float(r)])
        comm.all_reduce(ctl, purpose="control")  # control traffic always goes native
        for h in reversed(handles):
            h.wait()
        for h in handles:  # waiting twice is harmless
            h.wait()
        res["async"] = [torch.equal(w, t) for w, t in zip(work, want_x)] + [
            torch.equal(shard, want_rs), torch.equal(gathered, want_ag)]
        res["scalars"] = scal.tolist()
        res["control_ar"] = ctl.item()
        res["async_counts"] = comm.counter.snapshot()
        res["async_total"] = comm.counter.total()
        res["async_total_all"] = comm.counter.total(exclude=())
        comm.close()
        out[algo] = res
    return out


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"N{n}")
def world(request) -> tuple[int, list[dict]]:
    n = request.param
    return n, run_ranks(_facade_checks, n)


def _ring_all_reduce_bytes(numel: int, n: int, r: int) -> tuple[int, int]:
    """Observed by the ring: every chunk but r+1, then every chunk but r+2 (4-byte floats)."""
    base, extra = divmod(numel, n)
    c = [4 * (base + (i < extra)) for i in range(n)]
    return 8 * numel - c[(r + 1) % n] - c[(r + 2) % n], 8 * numel - c[r] - c[(r + 1) % n]


def _entry(calls: int, sent: float, recv: float, how: str) -> dict:
    return {"calls": calls, "sent_bytes": int(sent), "recv_bytes": int(recv), "how": how,
            "inter_sent_bytes": 0, "inter_recv_bytes": 0}  # one node


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["native", "ring"])
def test_sync_and_async_equal_native(world, algo):
    _, ranks = world
    for r, res in enumerate(ranks):
        assert res[algo]["sync"] == [True] * 3, r
        assert res[algo]["async"] == [True] * 5, r


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["native", "ring"])
def test_control_reductions(world, algo):
    n, ranks = world
    for res in ranks:
        assert res[algo]["scalars"] == [float(n), float(n * (n - 1) // 2)]
        assert res[algo]["control_ar"] == float(n * (n - 1) // 2)
        ctl = res[algo]["async_counts"]["control"]["all_reduce"]
        # fp64 pair + fp32 single, native and computed even under the ring algorithm
        assert ctl == _entry(2, 2 * (n - 1) / n * 16 + 2 * (n - 1) / n * 4,
                             2 * (n - 1) / n * 16 + 2 * (n - 1) / n * 4, "computed")
        sent, recv = res[algo]["async_total"]
        all_sent, all_recv = res[algo]["async_total_all"]
        assert all_sent - sent == ctl["sent_bytes"] and all_recv - recv == ctl["recv_bytes"]


@pytest.mark.slow
def test_ring_counts_observed_bytes(world):
    n, ranks = world
    f = (n - 1) / n
    for r, res in enumerate(ranks):
        sync = res["ring"]["sync_counts"]
        assert sync["grads"]["all_reduce"] == _entry(1, *_ring_all_reduce_bytes(7 * n + 3, n, r),
                                                     "observed")
        assert sync["grads"]["reduce_scatter"] == _entry(1, f * 20 * n, f * 20 * n, "observed")
        assert sync["params"]["all_gather"] == _entry(1, f * 20 * n, f * 20 * n, "observed")
        asy = res["ring"]["async_counts"]
        ar = [_ring_all_reduce_bytes(k * n + 1, n, r) for k in (1, 2, 3)]
        assert asy["grads"]["all_reduce"] == _entry(
            2, ar[0][0] + ar[2][0], ar[0][1] + ar[2][1], "observed")
        assert asy["params"]["all_reduce"] == _entry(1, *ar[1], "observed")
        assert asy["grads"]["reduce_scatter"] == _entry(1, f * 16 * n, f * 16 * n, "observed")
        assert asy["params"]["all_gather"] == _entry(1, f * 16 * n, f * 16 * n, "observed")
        grads_and_params = (ar[0][0] + ar[1][0] + ar[2][0] + 2 * int(f * 16 * n),
                            ar[0][1] + ar[1][1] + ar[2][1] + 2 * int(f * 16 * n))
        assert res["ring"]["async_total"] == grads_and_params


@pytest.mark.slow
def test_native_counts_computed_bytes(world):
    n, ranks = world
    f = (n - 1) / n
    for res in ranks:
        sync = res["native"]["sync_counts"]
        s_ar = 4 * (7 * n + 3)
        assert sync["grads"]["all_reduce"] == _entry(1, 2 * f * s_ar, 2 * f * s_ar, "computed")
        assert sync["grads"]["reduce_scatter"] == _entry(1, f * 20 * n, f * 20 * n, "computed")
        assert sync["params"]["all_gather"] == _entry(1, f * 20 * n, f * 20 * n, "computed")
        asy = res["native"]["async_counts"]
        assert asy["params"]["all_reduce"]["how"] == "computed"
        assert asy["grads"]["all_reduce"]["calls"] == 2


def _check_world_size_one(comm: Comm) -> None:
    assert comm.world_size == 1
    t = torch.arange(6.0)
    comm.all_reduce(t).wait()
    comm.all_reduce(t, async_op=True).wait()
    assert torch.equal(t, torch.arange(6.0))
    o = torch.empty(6)
    comm.reduce_scatter(o, t).wait()
    assert torch.equal(o, t)
    inplace = t.clone()
    comm.reduce_scatter(inplace, inplace).wait()
    assert torch.equal(inplace, t)
    g = torch.empty(6)
    comm.all_gather(g, t, async_op=True).wait()
    assert torch.equal(g, t)
    assert comm.all_reduce_scalars([2.0, 3.0]).tolist() == [2.0, 3.0]
    assert comm.counter.snapshot() == {} and comm.counter.total() == (0, 0)
    comm.close()


@pytest.mark.parametrize("algo", ["native", "ring"])
def test_world_size_one_is_a_no_op(algo):
    assert not dist.is_initialized()
    _check_world_size_one(Comm(algo))  # no process group at all
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _check_world_size_one(Comm(algo))  # a group of one
    finally:
        dist.destroy_process_group()


def test_unknown_algorithm_and_bad_sizes():
    with pytest.raises(ValueError, match=r"comm\.algorithm"):
        Comm("tree")
    comm = Comm("ring")
    with pytest.raises(ValueError, match="pad the flat buffer"):
        comm.reduce_scatter(torch.empty(2), torch.empty(3))
    with pytest.raises(ValueError, match="all_gather output"):
        comm.all_gather(torch.empty(3), torch.empty(2))


def _auto_choice() -> dict:
    """comm.algorithm auto on gloo: the ring for large reduce-scatters/all-gathers only."""
    r, n = dist.get_rank(), dist.get_world_size()
    comm = Comm("auto", ring_min_bytes=4 * 1000)
    small, big = _data(10 * n, r, 30), _data(1000 * n, r, 31)
    out_small, out_big = torch.empty(10), torch.empty(1000)
    comm.reduce_scatter(out_small, small)
    comm.reduce_scatter(out_big, big, purpose="params")
    ar = big.clone()
    comm.all_reduce(ar, purpose="other")
    snap = comm.counter.snapshot()
    comm.close()
    ok = [torch.equal(out_small, _ref_rs(small, 10)), torch.equal(out_big, _ref_rs(big, 1000)),
          torch.equal(ar, _ref_all_reduce(big))]
    return {"ok": ok, "snap": snap}


def test_auto_picks_ring_for_large_buffers_on_gloo():
    for res in run_ranks(_auto_choice, 2):
        assert res["ok"] == [True, True, True]
        assert res["snap"]["grads"]["reduce_scatter"]["how"] == "computed"  # small: native
        assert res["snap"]["params"]["reduce_scatter"]["how"] == "observed"  # big: ring
        assert res["snap"]["other"]["all_reduce"]["how"] == "computed"  # gloo's all-reduce
