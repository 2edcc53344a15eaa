"""FloatFormat against torch's own casts: every pattern decoded, a million values encoded."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from zerotrain.cli.float_bits import classify, decode, decode_exact, encode, format_bits, hex_bits
from zerotrain.cli.float_notation import parse_bits, parse_number
from zerotrain.numerics.codec import decode_tensor, encode_tensor
from zerotrain.numerics.formats import (
    ALL_FORMATS,
    BF16,
    FORMATS,
    FP8_E4M3,
    FP8_E5M2,
    FP16,
    FP32,
    TF32,
    FloatFormat,
    get_format,
)

# format name -> (torch dtype, integer dtype of the same width for .view)
TORCH = {
    "fp32": (torch.float32, torch.int32),
    "fp16": (torch.float16, torch.int16),
    "bf16": (torch.bfloat16, torch.int16),
    "fp8-e4m3": (torch.float8_e4m3fn, torch.uint8),
    "fp8-e5m2": (torch.float8_e5m2, torch.uint8),
}
NARROW = ["fp16", "bf16", "fp8-e4m3", "fp8-e5m2"]


def torch_bits(x: torch.Tensor, name: str) -> torch.Tensor:
    """torch's cast of x, as unsigned int64 patterns (the reference)."""
    dtype, view = TORCH[name]
    width = torch.finfo(dtype).bits
    return x.to(dtype).view(view).to(torch.int64) & ((1 << width) - 1)


def torch_values(patterns: torch.Tensor, name: str) -> torch.Tensor:
    """Reinterpret unsigned int64 patterns as the torch dtype, widened to float64."""
    dtype, view = TORCH[name]
    width = torch.finfo(dtype).bits
    p = patterns
    if view.is_signed:  # two's complement by hand, so no reliance on wrapping casts
        p = torch.where(p >= 1 << (width - 1), p - (1 << width), p)
    return p.to(view).view(dtype).to(torch.float64)


def assert_same_floats(ours: torch.Tensor, ref: torch.Tensor) -> None:
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(ours), nan)
    assert torch.equal(ours[~nan], ref[~nan])
    assert torch.equal(torch.signbit(ours[~nan]), torch.signbit(ref[~nan]))  # ±0


def assert_same_bits(ours: torch.Tensor, ref: torch.Tensor, fmt: FloatFormat, x: torch.Tensor):
    """Bit-exact, except that NaN inputs only need to give *a* NaN (torch's payloads vary)."""
    nan_in = torch.isnan(x)
    bad = (ours != ref) & ~nan_in
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{fmt.name}: {int(bad.sum())} mismatches, e.g. x={x[i].item()!r}: "
            f"ours {format_bits(fmt, int(ours[i]))} torch {format_bits(fmt, int(ref[i]))}"
        )
    assert torch.isnan(decode_tensor(fmt, ours[nan_in])).all()
    assert torch.isnan(decode_tensor(fmt, ref[nan_in])).all()


# ---- decoding: every pattern ---------------------------------------------------------------
@pytest.mark.parametrize("name", NARROW)
def test_decode_tensor_matches_torch_for_every_pattern(name: str) -> None:
    fmt = get_format(name)
    patterns = torch.arange(1 << fmt.total_bits, dtype=torch.int64)
    assert_same_floats(decode_tensor(fmt, patterns), torch_values(patterns, name))


@pytest.mark.parametrize("name", NARROW)
def test_scalar_decode_matches_torch_for_every_pattern(name: str) -> None:
    fmt = get_format(name)
    patterns = torch.arange(1 << fmt.total_bits, dtype=torch.int64)
    ref = torch_values(patterns, name)
    ours = torch.tensor([decode(fmt, p) for p in range(1 << fmt.total_bits)], dtype=torch.float64)
    assert_same_floats(ours, ref)
    exact = [decode_exact(fmt, p) for p in range(0, 1 << fmt.total_bits, 97)]
    for p, e in zip(range(0, 1 << fmt.total_bits, 97), exact):
        if isinstance(e, Fraction):
            assert float(e) == ref[p].item() and Fraction(ref[p].item()) == e


def test_decode_fp32_sample_matches_torch() -> None:
    g = torch.Generator().manual_seed(1)
    patterns = torch.randint(0, 1 << 32, (200_000,), generator=g, dtype=torch.int64)
    edge = torch.tensor([0, 1, 0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x80000000, 0x807FFFFF])
    patterns = torch.cat([patterns, edge])
    assert_same_floats(decode_tensor(FP32, patterns), torch_values(patterns, "fp32"))


@pytest.mark.parametrize("name", NARROW)
def test_encode_decode_round_trip_every_pattern(name: str) -> None:
    fmt = get_format(name)
    patterns = torch.arange(1 << fmt.total_bits, dtype=torch.int64)
    values = decode_tensor(fmt, patterns)
    back = encode_tensor(fmt, values)
    finite = ~torch.isnan(values)
    assert torch.equal(back[finite], patterns[finite])
    if fmt.total_bits == 8:  # the exact scalar path too
        for p in range(256):
            if not math.isnan(decode(fmt, p)):
                assert encode(fmt, decode(fmt, p)) == p
                exact = decode_exact(fmt, p)
                if isinstance(exact, Fraction) and exact != 0:
                    assert encode(fmt, exact) == p


# ---- encoding: a million values against torch's cast ---------------------------------------
def _random_fp32(n: int, lo: int, hi: int, g: torch.Generator) -> torch.Tensor:
    """Random float32 values with exponents spread evenly over [lo, hi] and both signs."""
    mant = 1 + torch.rand(n, generator=g, dtype=torch.float64)
    exp = torch.randint(lo, hi + 1, (n,), generator=g).to(torch.float64)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    return (sign * torch.ldexp(mant, exp)).to(torch.float32)


def _ties(name: str) -> torch.Tensor:
    """Exact midpoints between neighbours of the target format (from torch's own decode),
    with the float32 numbers just below and above each; both signs."""
    fmt = get_format(name)
    positive = torch.arange(0, fmt.sign_bit, dtype=torch.int64)
    vals = torch_values(positive, name)
    finite = torch.isfinite(vals)
    lo, hi = vals[:-1][finite[1:]], vals[1:][finite[1:]]
    mid = (lo + hi) / 2
    # the overflow boundary: halfway past max finite, one step past it, twice it
    below_max = torch_values(torch.tensor([fmt.max_finite_bits - 1]), name).item()
    mx, ulp = fmt.max_finite, fmt.max_finite - below_max
    edge = torch.tensor([mx + ulp / 2, mx + ulp, 2 * mx], dtype=torch.float64)
    mid = torch.cat([mid, edge[edge <= FP32.max_finite]])
    mid32 = mid.to(torch.float32)
    assert torch.equal(mid32.to(torch.float64), mid)  # every midpoint is an exact fp32 value
    inf = torch.full_like(mid32, math.inf)
    around = torch.cat([mid32, torch.nextafter(mid32, inf), torch.nextafter(mid32, -inf)])
    return torch.cat([around, -around])


SPECIALS = torch.tensor(
    [0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 3.4028234663852886e38, 1e-45, -1e-45],
    dtype=torch.float32,
)


@pytest.fixture(scope="module")
def fp32_inputs() -> torch.Tensor:
    """1M float32 values: uniformly random bit patterns (every exponent, subnormals, NaNs with
    payloads, infs) plus values concentrated on the narrow formats' ranges."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(1 << 31), 1 << 31, (400_000,), generator=g, dtype=torch.int64)
    uniform = bits.to(torch.int32).view(torch.float32)
    focused = [_random_fp32(150_000, f.emin - f.mantissa_bits - 3, f.emax + 2, g) for f in
               (FP16, BF16, FP8_E4M3, FP8_E5M2)]  # fmt: skip
    x = torch.cat([uniform, *focused, SPECIALS])
    assert x.numel() >= 1_000_000
    return x


@pytest.mark.parametrize("name", NARROW)
def test_encode_tensor_matches_torch_cast(name: str, fp32_inputs: torch.Tensor) -> None:
    fmt = get_format(name)
    x = torch.cat([fp32_inputs, _ties(name)])
    assert_same_bits(encode_tensor(fmt, x), torch_bits(x, name), fmt, x)


@pytest.mark.parametrize("name", NARROW)
def test_encode_default_nan_matches_torch(name: str) -> None:
    fmt = get_format(name)
    x = torch.tensor([math.nan], dtype=torch.float32)
    assert classify(fmt, int(encode_tensor(fmt, x)[0])) == "nan"
    if name != "bf16":  # torch's bf16 NaN depends on the code path (0x7FC0 or 0xFFFF)
        assert int(encode_tensor(fmt, x)[0]) == int(torch_bits(x, name)[0]) == encode(fmt, math.nan)
        assert encode(fmt, -math.nan) == int(torch_bits(-x, name)[0])


def _doubles_for_fp32(n: int, g: torch.Generator) -> torch.Tensor:
    """float64 inputs for fp32: any double (every exponent, NaN payloads), 52-bit mantissas
    around fp32's range and subnormals, and exact fp32 midpoints with their neighbours."""
    uniform = torch.randint(-(1 << 62), 1 << 62, (n // 4,), generator=g, dtype=torch.int64)
    uniform = (uniform * 2).view(torch.float64)
    mant = 1 + torch.rand(n // 2, generator=g, dtype=torch.float64)
    exp = torch.randint(-153, 130, (n // 2,), generator=g).to(torch.float64)
    sign = torch.where(torch.rand(n // 2, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    focused = sign * torch.ldexp(mant, exp)
    p = torch.randint(0, 0x7F7FFFFF, (n // 8,), generator=g, dtype=torch.int64)  # finite fp32
    mid = (torch_values(p, "fp32") + torch_values(p + 1, "fp32")) / 2  # exact: 25 bits
    inf = torch.full_like(mid, math.inf)
    ties = torch.cat([mid, torch.nextafter(mid, inf), torch.nextafter(mid, -inf)])
    edges = torch.tensor([3.4028235677973366e38, 3.402823567797337e38, 2.0**-150, 2.0**-149 * 1.5])
    return torch.cat([uniform, focused, ties, -ties, SPECIALS.to(torch.float64), edges])


def test_encode_fp32_from_float64_matches_torch() -> None:
    x = _doubles_for_fp32(1_200_000, torch.Generator().manual_seed(2))
    assert x.numel() >= 1_000_000
    assert_same_bits(encode_tensor(FP32, x), torch_bits(x, "fp32"), FP32, x)


@pytest.mark.parametrize("name", ["fp32", *NARROW])
def test_scalar_encode_matches_torch(name: str) -> None:
    """The exact (Fraction) path agrees with torch on a sample, ties and overflow included."""
    fmt = get_format(name)
    g = torch.Generator().manual_seed(3)
    if name == "fp32":
        x = _doubles_for_fp32(6000, g)
    else:
        ties = _ties(name)
        x = torch.cat([
            _random_fp32(3000, fmt.emin - fmt.mantissa_bits - 3, fmt.emax + 2, g),
            SPECIALS,
            ties[torch.randperm(ties.numel(), generator=g)[:1500]],
        ])  # fmt: skip
    ref = torch_bits(x, name)
    for xi, ri in zip(x.tolist(), ref.tolist()):
        if math.isnan(xi):
            assert classify(fmt, encode(fmt, xi)) == "nan"
        else:
            assert encode(fmt, xi) == ri, (name, xi)


def test_encode_rounds_once_from_the_exact_value() -> None:
    """A double just above an fp16 tie must round up; torch's float64→fp16 cast goes through
    fp32 first and rounds twice (landing on the even neighbour). We round once."""
    x = 1 + 2.0**-11 + 2.0**-40
    assert encode(FP16, x) == 0x3C01
    assert encode(FP16, parse_number("0.1")) == encode(FP16, 0.1) == 0x2E66
    assert encode(FP32, parse_number("0.1")) == 0x3DCCCCCD
    assert encode(FP32, Fraction(1, 3)) == 0x3EAAAAAB


def test_encode_tensor_is_vectorised() -> None:
    x = torch.randn(1_000_000)
    out = encode_tensor(FP8_E4M3, x)
    assert out.dtype == torch.int64 and out.shape == x.shape
    assert int(out.max()) < 256 and int(out.min()) >= 0


# ---- overflow behaviour, as torch does it --------------------------------------------------
def test_e4m3_saturates_like_torch() -> None:
    x = torch.tensor([448.0, 463.9, 464.0, 470.0, 1e6, math.inf, -math.inf, -1e6])
    assert torch_bits(x, "fp8-e4m3").tolist() == [0x7E] * 6 + [0xFE] * 2
    assert encode_tensor(FP8_E4M3, x).tolist() == [0x7E] * 6 + [0xFE] * 2
    assert [encode(FP8_E4M3, v) for v in x.tolist()] == [0x7E] * 6 + [0xFE] * 2
    assert classify(FP8_E4M3, 0x7F) == "nan" and classify(FP8_E4M3, 0x7E) == "normal"
    assert decode(FP8_E4M3, 0x78) == 256.0  # exponent 1111 is an ordinary exponent


def test_e5m2_and_fp16_overflow_to_inf() -> None:
    assert encode(FP8_E5M2, 61439.0) == 0x7B and encode(FP8_E5M2, 61440.0) == 0x7C  # tie → inf
    assert encode(FP16, 65519.99) == 0x7BFF and encode(FP16, 65520.0) == 0x7C00
    assert encode(FP16, -1e9) == 0xFC00
    assert encode(FP16, -0.0) == 0x8000 and encode(FP16, 0) == 0


# ---- derived properties --------------------------------------------------------------------
@pytest.mark.parametrize("name", list(TORCH))
def test_derived_properties_equal_torch_finfo(name: str) -> None:
    fmt, fi = get_format(name), torch.finfo(TORCH[name][0])
    assert fmt.max_finite == fi.max
    assert fmt.min_normal == fi.tiny == fi.smallest_normal
    smallest = torch_values(torch.tensor([1]), name).item()  # finfo has no smallest_subnormal
    assert fmt.min_subnormal == smallest > 0
    assert fmt.epsilon == fi.eps
    assert fmt.total_bits == fi.bits
    # torch's resolution is 10^-floor(m·log10 2); our digits are (m+1)·log10 2
    assert 10.0 ** -math.floor(fmt.decimal_digits - math.log10(2)) == pytest.approx(fi.resolution)
    assert fmt.torch_dtype is TORCH[name][0]


def test_properties_from_layout() -> None:
    assert FP8_E4M3.max_finite == 448 and FP8_E5M2.max_finite == 57344
    assert FP16.max_finite_exact == Fraction(65504)
    assert TF32.min_normal == FP32.min_normal and TF32.epsilon == 2.0**-10
    assert TF32.max_finite_exact == (2 - Fraction(1, 1024)) * 2**127
    assert TF32.torch_dtype is None and TF32.total_bits == 19
    assert BF16.max_finite_exact == (2 - Fraction(1, 128)) * 2**127
    assert round(FP32.decimal_digits, 2) == 7.22 and round(FP16.decimal_digits, 2) == 3.31
    custom = FloatFormat("e3m2", 3, 2)  # nothing is tabulated: any layout works
    assert custom.bias == 3 and custom.max_finite == 14 and custom.min_subnormal == 1 / 16


def test_tf32_is_fp32_range_with_fp16_precision() -> None:
    """No torch dtype, so borrow fp16's rounding: scale x into [1, 2) by an exact power of 2."""
    g = torch.Generator().manual_seed(4)
    x = _random_fp32(100_000, -120, 120, g).to(torch.float64)
    k = torch.floor(torch.log2(x.abs()))
    ref = torch.ldexp(torch.ldexp(x, -k).to(torch.float16).to(torch.float64), k)
    bits = encode_tensor(TF32, x)
    assert torch.equal(decode_tensor(TF32, bits), ref)
    assert torch.equal(bits, torch_bits(ref.to(torch.float32), "fp32") >> 13)


# ---- registry and text ---------------------------------------------------------------------
def test_registry_and_aliases() -> None:
    assert {f.name for f in ALL_FORMATS} <= set(FORMATS)
    aliases = {"float32": FP32, "half": FP16, "bfloat16": BF16, "E4M3": FP8_E4M3,
               "e5m2": FP8_E5M2, "float8_e4m3fn": FP8_E4M3, "TF32": TF32}  # fmt: skip
    for alias, fmt in aliases.items():
        assert get_format(alias) is fmt
    assert get_format(FP16) is FP16
    with pytest.raises(ValueError, match=r"fp32.*fp16.*bf16.*fp8-e4m3.*fp8-e5m2"):
        get_format("fp7")


def test_format_and_parse_bits() -> None:
    assert format_bits(FP32, encode(FP32, 9.625)) == "0 10000010 00110100000000000000000"
    assert parse_bits("0 10000010 00110100000000000000000") == (FP32, 0x411A0000)
    assert parse_bits("01000001000110100000000000000000") == (FP32, 0x411A0000)
    assert parse_bits("0x411A0000") == (FP32, 0x411A0000)
    assert parse_bits("0 01111 0000000000") == (FP16, 0x3C00)
    assert parse_bits("0 01111111 0000000") == (BF16, 0x3F80)
    assert parse_bits("1.1111.111") == (FP8_E4M3, 0xFF)
    assert parse_bits("0x3c00", "fp16") == (FP16, 0x3C00)
    assert parse_bits("01111100", FP8_E5M2)[1] == 0x7C
    g = torch.Generator().manual_seed(5)
    for fmt in ALL_FORMATS:
        for p in torch.randint(0, 1 << fmt.total_bits, (50,), generator=g).tolist():
            assert parse_bits(format_bits(fmt, p)) == (fmt, p)
            assert parse_bits(hex_bits(fmt, p), fmt) == (fmt, p)
    for bad, match in [
        ("0x3c00", "fp16.*bf16"),
        ("0011110000000000", "fp16.*bf16"),
        ("00111100", "fp8-e4m3.*fp8-e5m2"),
        ("0 1 1", "no format"),
        ("0 2 1", "0s and 1s"),
        ("10 0000 000", "sign"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_bits(bad)
    with pytest.raises(ValueError, match="bf16 is 1/8/7"):
        parse_bits("0 01111 0000000000", "bf16")
    with pytest.raises(ValueError, match="has 8 bits"):
        parse_bits("00111100", "fp16")
