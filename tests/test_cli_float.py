"""The `zerotrain float` / `zerotrain formats` explainers: right numbers, readable steps."""

from __future__ import annotations

import json
import random
import re
from fractions import Fraction

import pytest
import torch

from zerotrain.cli.float_bits import decode_exact, encode, format_bits
from zerotrain.cli.float_encode import explain_encode
from zerotrain.cli.float_notation import exact_decimal, parse_number
from zerotrain.cli.floats import main_float, main_formats
from zerotrain.numerics.formats import ALL_FORMATS, FP8_E4M3, FP16, FP32, get_format


def run_float(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main_float(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(out: str) -> dict[str, str]:
    """Table lines keyed by their first word, for the rows that name a format."""
    names = {f.name for f in ALL_FORMATS}
    return {ln.split()[0]: ln for ln in out.splitlines() if ln.split() and ln.split()[0] in names}


def pattern_line(out: str) -> str:
    """The line after 'Result:', without the hex."""
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("Result"))
    return lines[i + 1].split("(")[0].strip()


def test_worked_example_9_625(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_float(capsys, "9.625", "--format", "fp32")
    assert code == 0 and err == ""
    assert "0 10000010 00110100000000000000000" in out
    assert pattern_line(out) == "0 10000010 00110100000000000000000"
    for step in ("0.625 × 2 = 1.25 → 1", "0.25 × 2 = 0.5 → 0", "0.5 × 2 = 1 → 1"):
        assert step in out
    assert "9 ÷ 2 = 4 remainder 1" in out
    assert "1001.101₂" in out and "1.001101₂ × 2^3" in out
    assert "3 + 127 = 130 = 10000010₂" in out
    assert "00110100000000000000000" in out and "exact" in out


def test_decode_worked_example(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_float(capsys, "--bits", "0 10000010 00110100000000000000000")
    assert code == 0
    assert "fp32" in out and "E = 130 − 127 = 3" in out
    assert "1 + 2^-3 + 2^-4 + 2^-6" in out
    assert out.strip().splitlines()[-1].endswith("= 9.625")
    # unquoted fields (three argv words) and hex work too
    assert run_float(capsys, "--bits", "0", "10000010", "00110100000000000000000")[1] == out
    assert run_float(capsys, "--bits", "0x411A0000")[1].strip().endswith("= 9.625")


def test_repeating_fraction_and_rounding(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_float(capsys, "0.1")
    assert code == 0
    assert "0.1 × 2 = 0.2 → 0" in out and "0.8 × 2 = 1.6 → 1" in out
    assert "repeat" in out
    assert "G = 1" in out and "round up" in out
    assert pattern_line(out) == "0 01111011 10011001100110011001101"
    assert "0.100000001490116119384765625" in out  # the exact stored value


def test_tie_to_even_and_overflow(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_float(capsys, "65520", "--format", "fp16")[1]
    assert "ties-to-even" in out and "inf" in out
    assert pattern_line(out) == "0 11111 0000000000"
    out = run_float(capsys, "464", "-f", "e4m3")[1]  # a tie that rounds down to even 448
    assert "ties-to-even" in out and pattern_line(out) == "0 1111 110"


def test_e4m3_overflow_saturates_like_torch(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_float(capsys, "1000", "-f", "fp8-e4m3")[1]
    assert "saturate" in out
    torch_bits = torch.tensor([1000.0]).to(torch.float8_e4m3fn).view(torch.uint8).item()
    assert pattern_line(out) == format_bits(FP8_E4M3, torch_bits) == "0 1111 110"
    out = run_float(capsys, "inf", "-f", "e4m3")[1]
    assert "no infinity" in out and pattern_line(out) == "0 1111 110"


@pytest.mark.parametrize(
    ("argv", "pattern", "words"),
    [
        (["-2.5", "-f", "fp16"], "1 10000 0100000000", ["negative"]),
        (["-1e-8", "-f", "fp16"], "1 00000 0000000000", ["subnormal", "underflow"]),
        (["1e-6", "-f", "fp16"], "0 00000 0000010001", ["subnormal"]),
        (["1e-40"], "0 00000000 00000010001011011000010", ["subnormal"]),
        (["65504", "-f", "half"], "0 11110 1111111111", ["exact"]),
        (["1e38", "-f", "fp16"], "0 11111 0000000000", ["overflow"]),
        (["-inf", "-f", "fp16"], "1 11111 0000000000", ["infinity"]),
        (["nan", "-f", "bf16"], "0 11111111 1000000", ["NaN"]),
        (["nan", "-f", "e4m3"], "0 1111 111", ["NaN"]),
        (["0", "-f", "e5m2"], "0 00000 00", ["zero"]),
        (["-0", "-f", "fp16"], "1 00000 0000000000", ["sign"]),
        (["1/3", "-f", "bf16"], "0 01111101 0101011", ["repeat"]),
    ],
)
def test_encode_cases(
    capsys: pytest.CaptureFixture[str], argv: list[str], pattern: str, words: list[str]
) -> None:
    code, out, err = run_float(capsys, *argv)
    assert code == 0, err
    assert pattern_line(out) == pattern
    for w in words:
        assert w in out


def test_negative_numbers_and_extremes(capsys: pytest.CaptureFixture[str]) -> None:
    assert pattern_line(run_float(capsys, "--", "-2.5")[1]) == "1 10000000 01000000000000000000000"
    assert pattern_line(run_float(capsys, "-f", "fp16", "-2.5")[1]) == "1 10000 0100000000"
    assert pattern_line(run_float(capsys, "--format=fp16", "-2.5")[1]) == "1 10000 0100000000"
    out = run_float(capsys, "1e5000", "-f", "e4m3")[1]  # no 16,610 division steps
    assert "far above" in out and pattern_line(out) == "0 1111 110"
    out = run_float(capsys, "-1e-5000", "-f", "all")[1]
    assert out.count("rounds to zero") == len(ALL_FORMATS)


def _sample_values(fmt_name: str, rng: random.Random) -> list[str]:
    """Decimal strings: random, exact ties between neighbours, and the range edges."""
    fmt = get_format(fmt_name)
    vals = [f"{rng.uniform(1, 10):.{rng.randint(1, 9)}f}e{rng.randint(-50, 40)}" for _ in range(60)]
    for _ in range(40):
        p = rng.randrange(0, fmt.max_finite_bits)
        a, b = decode_exact(fmt, p), decode_exact(fmt, p + 1)
        assert isinstance(a, Fraction) and isinstance(b, Fraction)
        vals.append(exact_decimal((a + b) / 2))
    edges = [fmt.max_finite_exact, fmt.min_normal_exact, fmt.min_subnormal_exact]
    vals += [exact_decimal(e * k) for e in edges for k in (Fraction(1, 2), Fraction(3, 2), 1)]
    return vals + ["-" + v for v in vals[::7]]


@pytest.mark.parametrize("fmt_name", [f.name for f in ALL_FORMATS])
def test_derivation_agrees_with_encode(fmt_name: str) -> None:
    """The hand derivation computes its own bits (explain_encode asserts they equal encode);
    here the printed pattern must also be encode's, for random values, ties and edges."""
    fmt = get_format(fmt_name)
    for v in _sample_values(fmt_name, random.Random(fmt.total_bits)):
        out = explain_encode(v, fmt)
        assert pattern_line(out) == format_bits(fmt, encode(fmt, parse_number(v))), v


def test_format_all_has_a_row_per_format(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_float(capsys, "100000", "--format", "all")
    assert code == 0
    rows = table_rows(out)
    assert list(rows) == ["fp32", "tf32", "fp16", "bf16", "fp8-e4m3", "fp8-e5m2"]
    assert "exact" in rows["fp32"] and "99840" in rows["bf16"]
    assert "overflow" in rows["fp16"] and "inf" in rows["fp16"]
    assert "448" in rows["fp8-e4m3"] and "overflow" in rows["fp8-e4m3"]
    for fmt in ALL_FORMATS:
        assert format_bits(fmt, encode(fmt, 100000)) in rows[fmt.name]
    out = run_float(capsys, "-1e-6", "--format", "all")[1]
    assert "subnormal" in out and "rounds to zero" in out


def test_decode_special_patterns(capsys: pytest.CaptureFixture[str]) -> None:
    def last(*argv: str) -> str:
        code, out, err = run_float(capsys, *argv)
        assert code == 0, err
        return out

    out = last("--bits", "0 00000 0000000001")
    assert "subnormal" in out and "2^-14" in out and "0.000000059604644775390625" in out
    assert "-0" in last("--bits", "1 00000 0000000000")
    assert "+infinity" in last("--bits", "0 11111 0000000000")
    assert "NaN" in last("--bits", "0 11111 01")
    out = last("--bits", "1 1111 111")
    assert "fp8-e4m3" in out and "NaN" in out
    out = last("--bits", "0 1111 110")  # E4M3fn: top exponent is an ordinary one
    assert "E = 15 − 7 = 8" in out and out.strip().endswith("= 448")
    assert last("--bits", "0x3c00", "--format", "fp16").strip().endswith("= 1")
    assert last("--bits", "0x3c00", "--format", "bf16").strip().endswith("= 0.0078125")
    assert "tf32" in last("--bits", "0 10000010 0011010000")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["abc"], "cannot read 'abc'"),
        (["1.5", "--format", "fp7"], "unknown float format 'fp7'"),
        ([], "give either"),
        (["1.5", "--bits", "0x3c00"], "give either"),
        (["--bits", "0x3c00"], "fp16 (1/5/10) or bf16 (1/8/7)"),
        (["--bits", "00111100"], "fp8-e4m3"),
        (["--bits", "0 10 1"], "no format"),
        (["--bits", "0 01111 0000000000", "--format", "bf16"], "bf16 is 1/8/7"),
        (["--bits", "0x3c00", "--format", "all"], "--format all"),
        (["1", "--frobnicate"], "unrecognized"),
    ],
)
def test_bad_input_returns_2_with_one_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run_float(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_formats_table_matches_properties(capsys: pytest.CaptureFixture[str]) -> None:
    assert main_formats([]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    for fmt in ALL_FORMATS:
        row = rows[fmt.name]
        assert f"(1/{fmt.exponent_bits}/{fmt.mantissa_bits})" in row
        cols = re.split(r"\s{2,}", row)  # columns are separated by two or more spaces
        numbers = [float(c.split()[0]) for c in cols[1:8]]
        got = dict(zip(["bits", "bias", "max", "normal", "sub", "eps", "digits"], numbers))
        assert got["bits"] == fmt.total_bits and got["bias"] == fmt.bias
        assert got["max"] == pytest.approx(fmt.max_finite, rel=1e-5)
        assert got["normal"] == pytest.approx(fmt.min_normal, rel=1e-5)
        assert got["sub"] == pytest.approx(fmt.min_subnormal, rel=1e-5)
        assert got["eps"] == pytest.approx(fmt.epsilon, rel=1e-5)
        assert got["digits"] == pytest.approx(fmt.decimal_digits, abs=0.005)
        assert f"(2^{fmt.emin})" in row and f"(2^-{fmt.mantissa_bits})" in row
    assert "no inf; NaN = S.1111.111" in rows["fp8-e4m3"]
    assert "same range as fp32" in rows["bf16"]


def test_formats_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main_formats(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in data] == [f.name for f in ALL_FORMATS]
    for d, fmt in zip(data, ALL_FORMATS):
        assert d["max_finite"] == fmt.max_finite and d["min_subnormal"] == fmt.min_subnormal
        assert d["epsilon"] == fmt.epsilon and d["min_normal"] == fmt.min_normal
        assert Fraction(d["max_finite_exact"]) == fmt.max_finite_exact
    assert data[2]["max_finite_exact"] == "65504" and data[4]["has_inf"] is False
    assert main_formats(["--bogus"]) == 2


def test_exact_decimal() -> None:
    assert exact_decimal(Fraction(77, 8)) == "9.625"
    assert exact_decimal(Fraction(-1, 2**24)) == "-0.000000059604644775390625"
    assert exact_decimal(FP32.max_finite_exact) == "340282346638528859811704183484516925440"
    assert float(exact_decimal(FP16.min_subnormal_exact)) == FP16.min_subnormal


def test_float_shows_fp8_scaling_like_training(capsys):
    """`zerotrain float X --amax A`: the scale is FP8 training's own (numerics.fp8), and the
    unscaled value is torch's float8 cast round trip."""
    import re
    from fractions import Fraction

    import torch

    from zerotrain.cli import main
    from zerotrain.cli.floats import scale_for
    from zerotrain.numerics.formats import FP8_E4M3
    from zerotrain.numerics.fp8 import scale_from_amax

    for amax in (3000.0, 1.0, 0.37, 1e-5, 448.0, 449.0):
        want = float(scale_from_amax(torch.tensor(amax), FP8_E4M3))
        assert float(scale_for(FP8_E4M3, Fraction(amax))) == want, amax
    assert main(["float", "1000", "--format", "fp8-e4m3", "--amax", "3000"]) == 0
    out = capsys.readouterr().out
    got = float(re.search(r"stored value / scale = (\S+)", out).group(1))
    s = float(scale_for(FP8_E4M3, Fraction(3000)))
    cast = torch.tensor(1000.0 * s).to(torch.float8_e4m3fn).float().item() / s
    assert got == cast == 1024.0
