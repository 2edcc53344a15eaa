"""Compact model states (issue 32): int8/bf16 optimizer states, bf16 master weights with
Kahan compensation or stochastic rounding — numerics, ranks, resume, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from zerotrain.numerics import blockquant as Q
from zerotrain.optim import SGD, AdamW
from zerotrain.optim.compact import Compact


def _reference(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent fp64 block quantisation: per block of 256, scale = max |x|, each
    element the code (by exhaustive search) nearest to x / scale; also the gap between
    the best and the second-best distance (ties are a coin toss in any precision)."""
    book = Q.SIGNED if signed else Q.UNSIGNED
    x64 = x.double()
    out, margin = torch.empty_like(x64), torch.empty_like(x64)
    for s in range(0, x.numel(), 256):
        blk = x64[s : s + 256]
        scale = blk.abs().max().item()
        y = blk / scale if scale > 0 else blk
        d = (y[:, None] - book[None, :]).abs()
        two = d.topk(2, dim=1, largest=False).values
        out[s : s + 256] = book[d.argmin(dim=1)] * scale
        margin[s : s + 256] = (two[:, 1] - two[:, 0]) / y.abs().clamp(min=1e-12)  # relative
    return out, margin


@pytest.mark.parametrize("signed", [True, False])
def test_int8_blocks_match_fp64_reference(signed: bool) -> None:
    g = torch.Generator().manual_seed(1)
    n = 256 * 7 + 77  # a partial last block
    # magnitudes over 8 decades, so every part of the dynamic map is used
    x = torch.randn(n, generator=g) * 10 ** (-8 * torch.rand(n, generator=g))
    x[256:512] = 0.0  # an all-zero block
    if not signed:
        x = x.abs()
    codes = torch.empty(n, dtype=torch.uint8)
    scales = torch.empty(Q.n_blocks(n))
    Q.quantize_(x, codes, scales, signed)
    got = Q.dequantize(codes, scales, signed).double()
    ref, margin = _reference(x, signed)
    clear = (margin > 1e-6) | (x == 0)
    assert clear.float().mean() > 0.99
    torch.testing.assert_close(got[clear], ref[clear], rtol=1e-6, atol=0)
    assert torch.equal(got[256:512], torch.zeros(256, dtype=torch.float64))
    # the dynamic map: fine steps near the block's maximum (≤ 0.7% of it), and values
    # down to 10^-6 of it kept (never flushed to zero, as a linear map would)
    blk = x.double()[: 256 * 7].view(7, 256)
    y = blk / blk.abs().amax(1, keepdim=True).clamp(min=1e-30)
    err = (got[: 256 * 7].view(7, 256) - blk).abs() / blk.abs().amax(1, keepdim=True)
    assert err[y.abs() >= 0.1].max() < 0.0071
    assert (got[: 256 * 7].view(7, 256)[y.abs() >= 1e-6] != 0).all()


def test_stochastic_rounding_is_unbiased_and_deterministic() -> None:
    x = torch.full((200_000,), 1.0 + 2**-9)  # a quarter of the way from 1 to the next bf16
    r = Q.stochastic_bf16(x, Q.noise16(0, x.numel(), 7, x.device)).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(r.mean().item() - x[0].item()) < 4e-5
    again = Q.stochastic_bf16(x[1000:2000], Q.noise16(1000, 1000, 7, x.device)).float()
    assert torch.equal(again, r[1000:2000])  # the bits depend on the index only


def _tiny_updates(update: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """1,000 SGD steps of 1e-4 each (lr 1e-4 × gradient 1) on weights in [1, 1.5],
    where half a bf16 ulp is 0.004–0.008: every single update is below it. Returns
    how far each weight moved."""
    p = torch.nn.Parameter((1.0 + torch.linspace(0, 0.5, 512)).to(torch.bfloat16).to(dtype))
    start = p.detach().float().clone()
    opt = SGD([p], lr=1e-4)
    opt.compact = Compact("fp32", update)
    for _ in range(1000):
        p.grad = torch.ones_like(p)
        opt.step()
    return p.detach().float() - start


def test_kahan_tracks_fp32_where_plain_bf16_stalls() -> None:
    fp32 = _tiny_updates("none", torch.float32)  # fp32 masters: -0.1 each
    assert torch.allclose(fp32, torch.full_like(fp32, -0.1), atol=1e-4)
    assert _tiny_updates("plain").abs().max() == 0  # plain bf16: every update lost
    for update in ("kahan", "stochastic"):
        moved = _tiny_updates(update)
        # the mean within 2% of fp32's; Kahan's bf16 compensation holds ~16 bits, so
        # single weights stay within 5%
        assert abs(moved.mean().item() / fp32.mean().item() - 1) < 0.02, update
        if update == "kahan":
            assert ((moved - fp32).abs() < 0.005).all()


def test_compact_adamw_close_to_fp32() -> None:
    def run(spec: Compact, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        torch.manual_seed(0)
        target = torch.randn(32, 300)
        p = torch.nn.Parameter(torch.zeros(32, 300, dtype=dtype))
        opt = AdamW([p], lr=1e-2, weight_decay=0.0)
        opt.compact = spec
        for _ in range(60):
            p.grad = (p.float() - target).to(dtype) + 0.1 * torch.randn(32, 300).to(dtype)
            opt.step()
        return p.detach().float()

    fp32 = run(Compact())
    for spec, dtype, tol in (
        (Compact("bf16"), torch.float32, 0.01),
        (Compact("int8"), torch.float32, 0.05),
        (Compact("int8", "kahan"), torch.bfloat16, 0.05),
        (Compact("int8", "stochastic"), torch.bfloat16, 0.06),
    ):
        err = (run(spec, dtype) - fp32).norm() / fp32.norm()
        assert err < tol, (spec, float(err))
    assert math.isfinite(float(fp32.sum()))
