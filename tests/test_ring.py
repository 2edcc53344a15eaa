"""Ring collectives (SPEC §5) against torch.distributed's own, and `ring_bytes` against a
replay of the schedule (the `zerotrain ring` walk-through is tested in test_cli_ring.py).

Tolerances: fp32 inputs are integer-valued, so every summation order gives the same
exact result and ring == native is demanded bit for bit. bf16 inputs are random; N-1
bf16 additions each round with relative error ≤ u = 2^-8 (8-bit significand), so both
ring and native must lie within γ·Σ|x| of the exact (fp64) sum, γ = (N-1)u/(1-(N-1)u)
(the standard bound for recursive summation in any order).
Gathers do no arithmetic and are exact in any dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zerotrain.comm.ring import (
    ALL_GATHER,
    REDUCE_SCATTER,
    chunk_sizes,
    ring_all_gather,
    ring_all_reduce,
    ring_bytes,
    ring_reduce_scatter,
    ring_schedule,
)

from multirank import run_ranks

BF16_U = 2.0**-8


def _gamma(n: int) -> float:
    return (n - 1) * BF16_U / (1 - (n - 1) * BF16_U)


def _native_rs(out, inp, group=None):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def _native_ag(out, inp, group=None):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _data(numel: int, dtype: torch.dtype, rank: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype == torch.float32:  # integer-valued: exact under any summation order
        return torch.randint(-50, 50, (numel,), generator=g).float()
    return torch.randn(numel, generator=g).to(dtype)


def _bf16_error(result: torch.Tensor, local: torch.Tensor, n: int, group=None) -> float:
    """max over elements of |result - exact| / (γ·Σ|x|): must be ≤ 1."""
    exact = local.double()
    dist.all_reduce(exact, group=group)
    scale = local.double().abs()
    dist.all_reduce(scale, group=group)
    bound = _gamma(n) * scale + 1e-30
    return ((result.double() - exact).abs() / bound).max().item() if local.numel() else 0.0


def _bf16_error_full(result: torch.Tensor, local: torch.Tensor, n: int, chunk: slice) -> float:
    """As _bf16_error, for `result` = chunk `chunk` of the sum of the ranks' `local`."""
    exact, scale = local.double(), local.double().abs()
    dist.all_reduce(exact)
    dist.all_reduce(scale)
    bound = _gamma(n) * scale[chunk] + 1e-30
    return ((result.double() - exact[chunk]).abs() / bound).max().item()


def _compare(ring: torch.Tensor, native: torch.Tensor, local: torch.Tensor, n: int,
             group=None) -> dict:
    if ring.dtype == torch.float32:
        return {"exact": torch.equal(ring, native)}
    return {"ring_err": _bf16_error(ring, local, n, group),
            "native_err": _bf16_error(native, local, n, group)}


def _ring_vs_native() -> dict:
    """Every check for one world size, in one spawn (spawning costs seconds)."""
    r, n = dist.get_rank(), dist.get_world_size()
    out: dict = {"all_reduce": [], "reduce_scatter": [], "all_gather": [], "misc": {},
                 "p2p_batches": []}
    real_batch = dist.batch_isend_irecv

    def batch(ops):  # what each ring step hands to torch, as ("recv"?, "send"?)
        out["p2p_batches"].append(tuple(sorted(
            "send" if op.op is dist.isend else "recv" for op in ops)))
        return real_batch(ops)

    dist.batch_isend_irecv = batch
    salt = 0
    for dtype in (torch.float32, torch.bfloat16):
        # all-reduce: empty, smaller than N, not divisible by N, divisible by N
        for numel in (0, 1, n - 1, n + 1, 7 * n + 3, 64 * n):
            salt += 1
            x = _data(numel, dtype, r, salt)
            ring, native = x.clone(), x.clone()
            sent, recv = ring_all_reduce(ring)
            dist.all_reduce(native)
            out["all_reduce"].append({"numel": numel, "dtype": str(dtype), "sent": sent,
                                      "recv": recv, "esize": x.element_size(),
                                      **_compare(ring, native, x, n)})
        # reduce-scatter and all-gather, separate buffers and aliased
        for m in (1, 5, 33):
            for alias in (False, True):
                salt += 1
                x = _data(n * m, dtype, r, salt)
                native = torch.empty(m, dtype=dtype)
                _native_rs(native, x.clone())
                inp = x.clone()
                o = inp[r * m:(r + 1) * m] if alias else torch.empty(m, dtype=dtype)
                sent, recv = ring_reduce_scatter(o, inp)
                others = torch.cat([inp[: r * m], inp[(r + 1) * m:]])
                x_others = torch.cat([x[: r * m], x[(r + 1) * m:]])
                res = {"m": m, "alias": alias, "dtype": str(dtype), "sent": sent,
                       "recv": recv, "esize": x.element_size(),
                       "input_kept": torch.equal(others, x_others)
                       and (alias or torch.equal(inp, x))}
                if dtype == torch.float32:
                    res["exact"] = torch.equal(o, native)
                else:  # the bound for chunk r needs every rank's chunk r: reduce the input
                    chunk = slice(r * m, (r + 1) * m)
                    res["ring_err"] = _bf16_error_full(o, x, n, chunk)
                    res["native_err"] = _bf16_error_full(native, x, n, chunk)
                out["reduce_scatter"].append(res)

                salt += 1
                y = _data(m, dtype, r, salt)
                native_g = torch.empty(n * m, dtype=dtype)
                _native_ag(native_g, y)
                og = torch.full((n * m,), 7.0, dtype=dtype)
                if alias:
                    og[r * m:(r + 1) * m] = y
                    sent, recv = ring_all_gather(og, og[r * m:(r + 1) * m])
                else:
                    sent, recv = ring_all_gather(og, y)
                out["all_gather"].append({"m": m, "alias": alias, "dtype": str(dtype),
                                          "sent": sent, "recv": recv,
                                          "esize": y.element_size(),
                                          "exact": torch.equal(og, native_g)})

    misc = out["misc"]
    # non-contiguous tensor: reduced in place through a contiguous copy
    base = _data(30, torch.float32, r, 99).view(5, 6)
    t = base.t()
    ref = t.clone()
    dist.all_reduce(ref)
    ring_all_reduce(t)
    misc["non_contiguous"] = torch.equal(t, ref) and torch.equal(base.t(), ref)
    # shapes other than 1-D: output (2, m) from input (n, 2, m)
    x = _data(n * 6, torch.float32, r, 98).view(n, 2, 3)
    o, ref = torch.empty(2, 3), torch.empty(2, 3)
    ring_reduce_scatter(o, x)
    _native_rs(ref.view(-1), x.reshape(-1).clone())
    misc["rs_2d"] = torch.equal(o, ref)
    # a subgroup whose group ranks differ from global ranks (peers via get_global_rank)
    members = list(range(1, n)) if n > 2 else [1, 0]
    sub = dist.new_group(members)
    if r in members:
        x = _data(11, torch.float32, r, 97)
        a, b = x.clone(), x.clone()
        ring_all_reduce(a, sub)
        dist.all_reduce(b, group=sub)
        y = _data(3, torch.float32, r, 96)
        g1, g2 = torch.empty(3 * len(members)), torch.empty(3 * len(members))
        ring_all_gather(g1, y, sub)
        _native_ag(g2, y, sub)
        z = _data(3 * len(members), torch.float32, r, 95)
        s1, s2 = torch.empty(3), torch.empty(3)
        ring_reduce_scatter(s1, z, sub)
        _native_rs(s2, z.clone(), sub)
        misc["subgroup"] = torch.equal(a, b) and torch.equal(g1, g2) and torch.equal(s1, s2)
    else:
        misc["subgroup"] = True
    # wrong sizes are refused before any message is sent
    try:
        ring_reduce_scatter(torch.empty(3), torch.empty(3 * n + 1))
        misc["size_check"] = False
    except ValueError:
        misc["size_check"] = True
    return out


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"N{n}")
def world(request) -> tuple[int, list[dict]]:
    n = request.param
    return n, run_ranks(_ring_vs_native, n)


@pytest.mark.slow
def test_each_step_posts_its_send_and_receive_as_one_batch(world):
    """The ring over NCCL needs the send to r+1 and the receive from r-1 of a step
    posted together (batch_isend_irecv); as separate isend/irecv they serialise on one
    stream and every rank waits for its neighbour forever (review H1)."""
    _, ranks = world
    for res in ranks:
        kinds = set(res["p2p_batches"])
        assert ("recv", "send") in kinds, kinds
        assert kinds <= {("recv", "send"), ("send",), ("recv",)}, kinds


@pytest.mark.slow
def test_all_reduce_matches_native(world):
    _, ranks = world
    for r, res in enumerate(ranks):
        for case in res["all_reduce"]:
            if "exact" in case:
                assert case["exact"], (r, case)
            else:
                assert case["ring_err"] <= 1.0 and case["native_err"] <= 1.0, (r, case)


@pytest.mark.slow
def test_all_reduce_bytes_are_two_n_minus_one_over_n(world):
    n, ranks = world
    for r, res in enumerate(ranks):
        for case in res["all_reduce"]:
            numel, esize = case["numel"], case["esize"]
            assert (case["sent"], case["recv"]) == ring_bytes(numel, n, r, esize), (r, case)
            if numel % n == 0:  # even chunks: exactly 2(N-1)/N·S
                assert case["sent"] == case["recv"] == 2 * (n - 1) * numel * esize // n


@pytest.mark.slow
def test_reduce_scatter_matches_native_and_keeps_input(world):
    n, ranks = world
    for r, res in enumerate(ranks):
        for case in res["reduce_scatter"]:
            assert case["input_kept"], (r, case)
            if "exact" in case:
                assert case["exact"], (r, case)
            else:
                assert case["ring_err"] <= 1.0 and case["native_err"] <= 1.0, (r, case)
            s = n * case["m"] * case["esize"]
            assert case["sent"] == case["recv"] == (n - 1) * s // n, (r, case)


@pytest.mark.slow
def test_all_gather_matches_native(world):
    n, ranks = world
    for r, res in enumerate(ranks):
        for case in res["all_gather"]:
            assert case["exact"], (r, case)
            s = n * case["m"] * case["esize"]
            assert case["sent"] == case["recv"] == (n - 1) * s // n, (r, case)


@pytest.mark.slow
def test_non_contiguous_subgroup_and_size_check(world):
    _, ranks = world
    for r, res in enumerate(ranks):
        assert res["misc"] == {"non_contiguous": True, "rs_2d": True, "subgroup": True,
                               "size_check": True}, r


def test_single_process_is_a_no_op():
    assert not dist.is_initialized()
    t = torch.arange(5.0)
    assert ring_all_reduce(t) == (0, 0)
    assert torch.equal(t, torch.arange(5.0))
    o = torch.empty(5)
    assert ring_reduce_scatter(o, t) == (0, 0) and torch.equal(o, t)
    g = torch.empty(5)
    assert ring_all_gather(g, t) == (0, 0) and torch.equal(g, t)


# ---------------------------------------------------------------------- schedule
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_schedule_shape(n):
    steps = ring_schedule(n)
    assert [s.phase for s in steps] == [REDUCE_SCATTER] * (n - 1) + [ALL_GATHER] * (n - 1)
    for s in steps:
        assert [(t.src, t.dst) for t in s.transfers] == [(r, (r + 1) % n) for r in range(n)]
    for r in range(n):
        rs = [s for s in steps if s.phase == REDUCE_SCATTER]
        # SPEC: at step s rank r sends chunk (r-s) and adds chunk (r-s-1) from r-1
        assert [s.send_chunk(r) for s in rs] == [(r - i) % n for i in range(n - 1)]
        assert [s.recv_chunk(r) for s in rs] == [(r - i - 1) % n for i in range(n - 1)]
        if n > 1:
            assert rs[-1].recv_chunk(r) == (r + 1) % n
            shifted = [s for s in ring_schedule(n, shift=-1) if s.phase == REDUCE_SCATTER]
            assert shifted[-1].recv_chunk(r) == r  # torch's reduce_scatter: rank r ↦ chunk r


@pytest.mark.parametrize(("numel", "n", "sizes"), [
    (10, 3, [4, 3, 3]), (2, 4, [1, 1, 0, 0]), (0, 2, [0, 0]), (8, 4, [2, 2, 2, 2])])
def test_chunk_sizes(numel, n, sizes):
    assert chunk_sizes(numel, n) == sizes


def _replayed_bytes(numel: int, n: int, rank: int) -> tuple[int, int]:
    """Slow reference: walk the schedule and add up the chunks `rank` sends and receives."""
    sizes = chunk_sizes(numel, n)
    steps = ring_schedule(n)
    return (sum(sizes[s.send_chunk(rank)] for s in steps),
            sum(sizes[s.recv_chunk(rank)] for s in steps))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7])
def test_ring_bytes_equal_a_replay_of_the_schedule(n):
    for numel in [*range(0, 3 * n + 2), 1000, 10_007]:
        for r in range(n):
            assert ring_bytes(numel, n, r) == _replayed_bytes(numel, n, r), (numel, r)
            assert ring_bytes(numel, n, r, 4) == tuple(4 * b for b in _replayed_bytes(
                numel, n, r))
        if numel % n == 0:  # even chunks: exactly 2(N-1)/N of the buffer each way
            assert {ring_bytes(numel, n, r) for r in range(n)} == {
                (2 * (n - 1) * numel // n,) * 2}
    with pytest.raises(ValueError):
        ring_bytes(10, 3, 3)
