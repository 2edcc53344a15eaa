"""FP8 linear layers: scales, the codec-built reference, delayed scaling, the config.

The reference quantises with `numerics.codec` only (x·s → E4M3/E5M2 bit patterns →
values / s) and multiplies in fp32, with scales computed exactly (Fractions); the
emulated layer must equal it bit for bit. Model-level checks (GPT training, ZeRO-3
FP8 all-gather) are in tests/test_fp8_model.py.
"""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest
import torch
from torch import Tensor, nn

from zerotrain.config import ConfigError, build_config
from zerotrain.numerics.codec import decode_tensor, encode_tensor
from zerotrain.numerics.formats import FP8_E4M3, FP8_E5M2, FloatFormat, floor_log2
from zerotrain.numerics.fp8 import FP8Recipe, FP8Stats, amax, quantize, scale_from_amax
from zerotrain.numerics.fp8_linear import Fp8Linear
from zerotrain.numerics.fp8_mm import dequantize_fp8, fp8_mm, scaled_mm_out_dtype

E4, E5 = FP8_E4M3, FP8_E5M2


# ---------------------------------------------------------------- the codec reference
def ref_scale(a: float, fmt: FloatFormat) -> float:
    """Largest 2^k with max(a, 2^-64)·2^k ≤ fmt.max, in exact rational arithmetic."""
    ratio = Fraction(fmt.max_finite) / Fraction(max(a, 2.0**-64))
    return 2.0 ** floor_log2(ratio.numerator, ratio.denominator)


def ref_scales(t: Tensor, fmt: FloatFormat, rows: bool) -> Tensor:
    if not rows:
        return torch.tensor(ref_scale(t.abs().max().item(), fmt))
    return torch.tensor([[ref_scale(r.abs().max().item(), fmt)] for r in t])


def codec_values(t: Tensor, s: Tensor, fmt: FloatFormat) -> Tensor:
    """The FP8 values (not yet unscaled) of t·s: saturate, encode, decode with the codec."""
    ts = t.float() * s
    if not fmt.has_inf:  # E4M3fn's codec saturates by itself; E5M2's would give inf
        assert fmt.overflow == "saturate"
    else:
        ts = ts.clamp(-fmt.max_finite, fmt.max_finite)
    return decode_tensor(fmt, encode_tensor(fmt, ts)).float()


def ref_linear(x: Tensor, w: Tensor, b: Tensor | None, g: Tensor, scaling: str,
               past: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(y, grad_input, grad_weight) of the FP8 recipe, built from the codec and fp32 matmuls.

    `past`: the delayed recipe's history max per class (input, weight, grad); 0 = empty.
    """
    rows = scaling == "rowwise"
    x2, g2 = x.reshape(-1, x.shape[-1]).float(), g.reshape(-1, g.shape[-1]).float()

    def scale(t: Tensor, fmt: FloatFormat, cls: int, r: bool = rows) -> Tensor:
        if past is not None and past[cls] > 0:
            return torch.tensor(ref_scale(past[cls].item(), fmt))
        return ref_scales(t, fmt, r)

    sx, sw = scale(x2, E4, 0), scale(w, E4, 1)
    xq, wq = codec_values(x2, sx, E4), codec_values(w, sw, E4)
    xd, wd = xq / sx, wq / sw
    y = xd @ wd.t()
    if b is not None:
        y = y + b.float()
    if rows:  # fold the reduction-dim row scales into g, quantise g per row, per product
        ga = g2 / sw.t()
        sga = scale(ga, E5, 2)
        gx = (codec_values(ga, sga, E5) / sga) @ wq
        gb = (g2 / sx).t()
        sgb = scale(gb, E5, 2)
        gw = (codec_values(gb, sgb, E5) / sgb) @ xq
    else:
        sg = scale(g2, E5, 2, False)
        gd = codec_values(g2, sg, E5) / sg
        gx, gw = gd @ wd, gd.t() @ xd
    return y.to(x.dtype).reshape(*x.shape[:-1], -1), gx.to(x.dtype).reshape(x.shape), gw


def run_layer(layer: nn.Module, x: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad


def make(scaling: str, bias: bool = True, matmul: str = "emulate", k: int = 48, n: int = 40,
         dtype: torch.dtype = torch.float32, seed: int = 0, **kw) -> Fp8Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias).to(dtype)
    return Fp8Linear.from_linear(lin, FP8Recipe(scaling, matmul=matmul, **kw))


def spread(*shape: int, seed: int = 1) -> Tensor:
    """Values over many binades (log-normal magnitudes), so subnormals and ties occur."""
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp(2.5 * torch.randn(*shape, generator=gen))
    return mag * torch.randn(*shape, generator=gen).sign()


# ---------------------------------------------------------------- scales and counts
def test_pow2_scale_is_largest_power_of_two_that_fits():
    a = torch.cat([spread(2000), torch.tensor([1.0, 448.0, 447.99, 2.0**-70, 3e38])]).abs()
    for fmt in (E4, E5):
        s = scale_from_amax(a, fmt)
        want = torch.tensor([ref_scale(v, fmt) for v in a.tolist()])
        assert torch.equal(s, want)
        assert bool((a * s <= fmt.max_finite).all())


def test_scale_guards_zero_and_nonfinite():
    z = torch.zeros(5, 7)
    q, counts = quantize(z, scale_from_amax(amax(z), E4), E4)
    assert torch.equal(q.float(), z) and counts.tolist() == [0, 0]  # zeros stay zero
    for bad in (float("inf"), float("nan")):
        x = torch.randn(4, 8)
        x[1, 2] = bad
        s = scale_from_amax(amax(x), E4)
        q, _ = quantize(x, s, E4)
        # a non-finite input poisons the whole tensor (NaN): the step's non-finite
        # gradient check sees it, instead of training on silently saturated values
        assert bool(torch.isnan(q.float() / s).all())
    a = torch.tensor([1.0, 3.0])
    s = scale_from_amax(a, E4, pow2=False)  # fp32 448/a, one ulp less where a·s > 448
    assert s[0] == 448.0 and 0 <= float(448.0 / a[1] - s[1]) <= 2.0**-16


def test_dynamic_scales_never_overflow():
    """amax·scale ≤ max exactly, with or without power-of-two rounding, so a dynamic
    (tensorwise/rowwise) cast never counts its own largest element as an overflow."""
    a = torch.exp(4 * torch.randn(200_000, generator=torch.Generator().manual_seed(3)))
    for fmt in (E4, E5):
        for pow2 in (True, False):
            s = scale_from_amax(a, fmt, pow2)
            assert bool((a * s <= fmt.max_finite).all())  # the fp32 product quantize forms
            if pow2:  # exact products: no rounding was needed to stay in range
                assert bool((a.double() * s.double() <= fmt.max_finite).all())


def test_rowwise_amax_shapes():
    x = spread(6, 10)
    a = amax(x, rows=True)
    assert a.shape == (6, 1) and torch.equal(a[:, 0], x.abs().amax(dim=1))
    assert amax(x).shape == () and amax(torch.empty(0, 3), rows=True).shape == (0, 1)
    s = scale_from_amax(a, E4)
    q, _ = quantize(x, s, E4)
    assert q.shape == x.shape and torch.equal(q.float().abs().amax(dim=1) <= 448, torch.ones(6,
                                                                                        dtype=bool))


@pytest.mark.parametrize("fmt", [E4, E5])
def test_quantize_matches_codec_and_counts(fmt):
    x = torch.cat([spread(4000), torch.tensor([1e-9, -3e-8, 1e6, -2e5])])
    s = torch.tensor(4.0)  # scaled values reach past both formats' max and below their min
    q, counts = quantize(x, s, fmt)
    want = codec_values(x, s, fmt)
    assert torch.equal(q.float(), want)
    xs = x.double() * 4.0  # exact
    over = int((xs.abs() > fmt.max_finite).sum())
    under = int(((want == 0) & (xs != 0)).sum())
    assert over > 0 and under > 0  # the data exercises both counts
    assert counts.tolist() == [over, under]


def test_decode_table_equals_torch_casts():
    """The emulation decodes FP8 by a codec-built table; torch's own cast must agree on
    all 256 patterns (NaN patterns: both NaN), scaled or not."""
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q = torch.arange(256, dtype=torch.uint8).view(dtype)
        want = q.to(torch.float32)
        for s in (None, torch.tensor(8.0), torch.full((256, 1), 0.25)):
            qq = q.view(256, 1) if s is not None and s.ndim else q
            got = dequantize_fp8(qq, s).view(-1)
            w = want / (s.view(-1) if s is not None else 1.0)
            assert torch.equal(torch.isnan(got), torch.isnan(w))
            assert torch.equal(got[~torch.isnan(got)], w[~torch.isnan(w)])


# ---------------------------------------------------------------- the layer vs the codec
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "delayed"])
@pytest.mark.parametrize("bias", [True, False])
def test_emulated_linear_equals_codec_reference(scaling, bias):
    layer = make(scaling, bias)
    x, g = spread(3, 5, 48, seed=2), spread(3, 5, 40, seed=3) * 1e-3
    y, gx, gw = run_layer(layer, x, g)
    ry, rgx, rgw = ref_linear(x, layer.weight.detach(), layer.bias, g, scaling)
    assert torch.equal(y, ry) and torch.equal(gx, rgx) and torch.equal(gw, rgw)
    if bias:
        assert torch.equal(layer.bias.grad, g.reshape(-1, 40).sum(0))


def test_emulated_linear_bf16_equals_codec_reference():
    layer = make("tensorwise", dtype=torch.bfloat16)
    x, g = spread(16, 48, seed=4).bfloat16(), spread(16, 40, seed=5).bfloat16()
    y, gx, gw = run_layer(layer, x, g)
    ry, rgx, rgw = ref_linear(x, layer.weight.detach(), layer.bias, g, "tensorwise")
    assert y.dtype == gx.dtype == gw.dtype == torch.bfloat16
    assert torch.equal(y, ry) and torch.equal(gx, rgx) and torch.equal(gw, rgw.bfloat16())


def test_delayed_uses_history_and_equals_reference():
    layer = make("delayed", amax_history=4)
    layer.fp8_amax_history[:, 1] = torch.tensor([3.0, 0.5, 2e-2])
    layer.fp8_amax_history[:, 3] = torch.tensor([1.0, 0.25, 7e-3])
    x, g = spread(20, 48, seed=6), spread(20, 40, seed=7) * 1e-3
    y, gx, gw = run_layer(layer, x, g)
    ry, rgx, rgw = ref_linear(x, layer.weight.detach(), layer.bias, g, "delayed",
                              past=torch.tensor([3.0, 0.5, 2e-2]))
    assert torch.equal(y, ry) and torch.equal(gx, rgx) and torch.equal(gw, rgw)


# ---------------------------------------------------------------- _scaled_mm vs emulation
def _mm_bound(a: Tensor, b: Tensor) -> Tensor:
    """|error| bound of an fp32 sum of K exact products in any order: K·2^-24·(|a|@|b|).
    Both paths form the same exact products (FP8 × FP8 fits fp32; power-of-two scales are
    exact), so only the order of the fp32 accumulation may differ."""
    return a.shape[1] * 2.0**-24 * (a.abs() @ b.abs())


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "delayed"])
def test_scaled_mm_path_matches_emulation(scaling):
    ok = scaled_mm_out_dtype("cpu", torch.float8_e4m3fn, torch.float8_e4m3fn,
                             scaling == "rowwise")
    emu, fast = make(scaling, matmul="emulate"), make(scaling, matmul="scaled_mm")
    x, g = spread(64, 48, seed=8), spread(64, 40, seed=9)
    outs = [run_layer(m, x, g) for m in (emu, fast)]
    x8, sx = emu.cast(x, 0, E4, scaling == "rowwise")
    w8, sw = emu.cast(emu.weight.detach(), 1, E4, scaling == "rowwise")
    a, b = x8.float() / sx, (w8.float() / sw).t()
    bound = _mm_bound(a, b)
    if ok is None:  # no usable kernel: "scaled_mm" falls back to the very same emulation
        assert all(torch.equal(e, f) for e, f in zip(*outs))
    assert bool(((outs[0][0] - outs[1][0]).abs() <= bound).all())
    for e, f in zip(outs[0][1:], outs[1][1:]):  # backward: relative to the result's scale
        assert torch.allclose(e, f, rtol=0, atol=64 * 2.0**-24 * float(e.abs().max()))


def test_fp8_mm_scale_shapes():
    a8 = spread(32, 16, seed=10).clamp(-448, 448).to(torch.float8_e4m3fn)
    b8 = spread(16, 24, seed=11).clamp(-448, 448).to(torch.float8_e4m3fn)
    sa, sb = torch.full((32, 1), 4.0), torch.full((1, 24), 0.5)
    want = (a8.float() / sa) @ (b8.float() / sb)
    for mm in ("emulate", "scaled_mm"):
        got = fp8_mm(a8, sa, b8, sb, mm)
        assert torch.allclose(got, want, rtol=0, atol=float(_mm_bound(a8.float() / sa,
                                                                      b8.float() / sb).max()))


# ---------------------------------------------------------------- delayed scaling
def test_delayed_overflows_on_a_spike_that_tensorwise_absorbs():
    """The issue's case: activations of amax ~1 for a few steps, then one of 100. The
    delayed scale still comes from the history (256 for amax 1), so the spike saturates at
    448/256 = 1.75 and is counted; tensorwise rescales for it and loses nothing."""
    results = {}
    for scaling in ("delayed", "tensorwise"):
        layer = make(scaling, amax_history=4)
        for step in range(3):
            x = spread(8, 48, seed=20 + step)
            x = x / x.abs().max()  # amax 1
            layer(x).sum().backward()
            layer.stats.end_step()
        spike = spread(8, 48, seed=30)
        spike = spike / spike.abs().max()
        spike[3, 5] = 100.0
        y = layer(spike).detach()
        results[scaling] = (layer.stats.snapshot()["input"]["overflow"], y)
    ref = spike @ layer.weight.detach().t() + layer.bias.detach()
    (d_over, d_y), (t_over, t_y) = results["delayed"], results["tensorwise"]
    assert d_over == 1 and t_over == 0
    err = lambda y: float((y[3] - ref[3]).norm() / ref[3].norm())  # noqa: E731
    assert err(t_y) < 0.1 < err(d_y)  # the saturated row is badly wrong only under delayed


def test_history_update_roll_and_reduce():
    layer = make("delayed", amax_history=3)
    xs = [spread(4, 48, seed=s) for s in (40, 41, 42, 43)]
    seen: list[Tensor] = []
    for i, x in enumerate(xs):
        layer(x).sum().backward()
        layer(x * 0.5).sum().backward()  # a second micro-step: the step's max is kept
        layer.stats.end_step(reduce_max=lambda t: seen.append(t.clone()))
        assert torch.equal(layer.fp8_amax_pending, torch.zeros(3))
        newest = layer.fp8_amax_history[:, 0]
        assert newest[0] == x.abs().max() and newest[1] == layer.weight.abs().max()
        assert newest[2] == 1.0  # d(sum)/dy = 1 everywhere
        assert torch.equal(seen[-1], layer.fp8_amax_history[:, 0].unsqueeze(0))
        if i >= 2:  # length 3: the oldest entry falls off
            assert layer.fp8_amax_history[0].tolist() == [
                float(v.abs().max()) for v in reversed(xs[i - 2:i + 1])]
    layer.roll_history(torch.tensor([float("inf"), float("nan"), 2.0]))
    assert layer.fp8_amax_history[:, 0].tolist() == [0.0, 0.0, 2.0]  # non-finite: not recorded


def test_history_survives_a_checkpoint():
    layer = make("delayed", amax_history=5)
    for s in range(3):
        layer(spread(4, 48, seed=50 + s) * (s + 1)).sum().backward()
        layer.stats.end_step()
    sd = layer.state_dict()
    assert torch.equal(sd["fp8_amax_history"], layer.fp8_amax_history)
    assert "fp8_amax_pending" not in sd
    fresh = make("delayed", amax_history=5, seed=99)
    fresh.load_state_dict(sd)
    x = spread(4, 48, seed=60) * 7
    assert torch.equal(fresh(x), layer(x))  # same weights, same history → same scales
    short = make("delayed", amax_history=2, seed=99)
    short.load_state_dict(sd)  # another length keeps the newest entries
    assert torch.equal(short.fp8_amax_history, layer.fp8_amax_history[:, :2])
    layer.to(torch.bfloat16)  # the history stays fp32 when the layer changes dtype
    assert layer.fp8_amax_history.dtype == torch.float32 and layer.weight.dtype == torch.bfloat16
    assert torch.equal(layer.fp8_amax_history, sd["fp8_amax_history"])
    plain = make("tensorwise", seed=99)
    plain.load_state_dict(sd)  # a layer without history ignores a saved one
    assert set(plain.state_dict()) == {"weight", "bias"}


def test_stats_snapshot_reset_and_sum():
    stats = FP8Stats()
    stats.add(0, torch.tensor([2, 3]))
    stats.add(2, torch.tensor([0, 5]))
    assert stats.snapshot()["input"] == {"overflow": 2, "underflow": 3}
    snap = stats.end_step(reduce_sum=lambda t: t.mul_(2))  # two ranks with equal counts
    assert snap["grad_output"] == {"overflow": 0, "underflow": 10}
    assert stats.counts.sum() == 0


# ---------------------------------------------------------------- config
def test_fp8_config_fields_and_impossible_combinations():
    cfg = build_config({"precision": {"dtype": "bf16", "fp8": {"enabled": True,
                                                                "recipe": "delayed"}}})
    assert cfg.precision.fp8.recipe == "delayed" and cfg.precision.fp8.amax_history == 16
    assert not build_config().precision.fp8.enabled
    r = FP8Recipe.from_config(cfg.precision.fp8)
    assert (r.scaling, r.amax_history, r.pow2_scales, r.matmul) == ("delayed", 16, True, "auto")
    bad = [
        ({"precision": {"dtype": "fp16", "fp8": {"enabled": True}}}, "fp16"),
        ({"precision": {"fp8": {"enabled": True, "all_gather": True}}}, "zero.stage 3"),
        ({"precision": {"fp8": {"all_gather": True}}, "zero": {"stage": 3}}, "enabled"),
        ({"precision": {"fp8": {"recipe": "blockwise"}}}, "recipe"),
        ({"precision": {"fp8": {"amax_history": 0}}}, "amax_history"),
    ]
    for data, word in bad:
        with pytest.raises(ConfigError, match=word):
            build_config(data)
    ok = build_config({"precision": {"fp8": {"enabled": True, "all_gather": True}},
                       "zero": {"stage": 3}})
    assert ok.precision.fp8.all_gather


def test_layer_keeps_the_linear_parameters():
    lin = nn.Linear(48, 40)
    ref = copy.deepcopy(lin)
    f = Fp8Linear.from_linear(lin, FP8Recipe())
    assert f.weight is lin.weight and f.bias is lin.bias
    assert list(f.state_dict()) == list(ref.state_dict()) and isinstance(f, nn.Linear)
    assert torch.equal(f.weight, ref.weight)
    built = Fp8Linear(48, 40, recipe=FP8Recipe("delayed", amax_history=2))  # constructor too
    built(torch.randn(3, 48)).sum().backward()
    assert built.fp8_amax_history.shape == (3, 2) and built.stats.modules == [built]


# ---------------------------------------------------------------- GPU (FP8 tensor cores)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "delayed"])
def test_cuda_scaled_mm_matches_emulation(scaling):
    """On a GPU with FP8 matmul (sm_89+) `auto` takes torch._scaled_mm; it must agree with
    the emulation within fp32 accumulation error (bf16 output where the kernel insists)."""
    dev = torch.device("cuda")
    rows = scaling == "rowwise"
    kinds = {(a, b): scaled_mm_out_dtype(f"cuda:{torch.cuda.current_device()}", a, b, rows)
             for a, b in [(torch.float8_e4m3fn,) * 2, (torch.float8_e5m2, torch.float8_e4m3fn)]}
    print(f"{scaling}: _scaled_mm output dtype per operand dtypes: {kinds}")
    emu = make(scaling, matmul="emulate", k=256, n=128).to(dev)
    fast = make(scaling, matmul="auto", k=256, n=128).to(dev)
    x, g = spread(512, 256, seed=70).to(dev), spread(512, 128, seed=71).to(dev)
    for e, f in zip(run_layer(emu, x, g), run_layer(fast, x, g)):
        # bf16 output rounding (2^-8 relative) dominates fp32 accumulation differences
        assert torch.allclose(e, f, rtol=2.0**-7, atol=2.0**-7 * float(e.abs().max()) / 64)
