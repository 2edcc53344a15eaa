"""`zerotrain ring`: the symbolic walk-through, the traffic lines, and the --run check."""

from __future__ import annotations

import re

import pytest

from zerotrain.cli.args import parse_size
from zerotrain.cli.ring import busiest_ring_bytes, main_ring, symbolic_walkthrough
from zerotrain.comm.ring import ring_bytes


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_symbolic_after_reduce_scatter_rank_r_owns_chunk_r_plus_1(n):
    snaps = symbolic_walkthrough(n)
    assert len(snaps) == 1 + 2 * (n - 1)
    after_rs = snaps[n - 1].holds
    for r in range(n):
        c = (r + 1) % n
        # full sum, contributions in ring order starting at the originating rank c
        assert after_rs[r][c] == tuple((c + k) % n for k in range(n))
    final = snaps[-1].holds
    for r in range(n):
        for c in range(n):
            assert final[r][c] == tuple((c + k) % n for k in range(n))
    for s in snaps[1:]:
        assert len(s.updated) == n


def test_symbolic_contribution_order():
    snaps = symbolic_walkthrough(3)
    assert snaps[0].holds[1][0] == (1,)
    assert snaps[1].holds[1][0] == (0, 1)  # RS step 1: GPU1 chunk A = a0+a1
    assert snaps[1].holds[0][2] == (2, 0)  # GPU0 chunk C = c2+c0
    assert snaps[2].holds[2][0] == (0, 1, 2)
    assert snaps[2].holds[0][1] == (1, 2, 0)
    assert snaps[3].holds[0][0] == (0, 1, 2)  # AG step 1 delivers A to GPU0


# ---------------------------------------------------------------------- CLI
def _tables(text: str) -> dict[str, list[list[str]]]:
    """{title: rows of cells} for every printed table."""
    out: dict[str, list[list[str]]] = {}
    for block in text.split("\n\n"):
        lines = block.strip("\n").splitlines()
        if len(lines) >= 3 and re.fullmatch(r"\s+A(\s+[B-Z])*", lines[1]):
            out[lines[0]] = [ln.split()[1:] for ln in lines[2:]]
    return out


def _find(tables: dict, prefix: str) -> list[list[str]]:
    (rows,) = [v for k, v in tables.items() if k.startswith(prefix)]
    return rows


def test_main_ring_n3(capsys):
    assert main_ring(["--gpus", "3", "--size", "28GB"]) == 0
    text = capsys.readouterr().out
    t = _tables(text)
    assert len(t) == 5
    assert _find(t, "Initial")[1] == ["a1", "b1", "c1"]
    assert _find(t, "Reduce-scatter step 1/2") == [
        ["a0", "b0", "c2+c0*"], ["a0+a1*", "b1", "c1"], ["a2", "b1+b2*", "c2"]]
    assert _find(t, "Reduce-scatter step 2/2")[2] == ["a0+a1+a2*", "b1+b2", "c2"]
    assert _find(t, "All-gather step 2/2") == [
        ["a0+a1+a2", "b1+b2+b0", "c2+c0+c1*"], ["a0+a1+a2*", "b1+b2+b0", "c2+c0+c1"],
        ["a0+a1+a2", "b1+b2+b0*", "c2+c0+c1"]]
    assert "28,000,000,000 bytes" in text
    assert re.search(r"\(N-1\)·S\s+=\s+56\.00 GB", text)
    assert re.search(r"2\(N-1\)/N·S\s+=\s+37\.33 GB", text)
    assert "1.50x" in text


def test_main_ring_n4(capsys):
    assert main_ring(["--gpus", "4"]) == 0  # default --size 28GB
    text = capsys.readouterr().out
    t = _tables(text)
    assert len(t) == 7
    assert _find(t, "Reduce-scatter step 1/3")[1] == ["a0+a1*", "b1", "c1", "d1"]
    assert _find(t, "Reduce-scatter step 3/3")[3] == ["a0+a1+a2+a3*", "b1+b2+b3", "c2+c3",
                                                      "d3"]
    assert _find(t, "Reduce-scatter step 3/3")[0][1] == "b1+b2+b3+b0*"
    assert _find(t, "All-gather step 3/3")[2][3] == "d3+d0+d1+d2"
    assert re.search(r"\(N-1\)·S\s+=\s+84\.00 GB", text)
    assert re.search(r"2\(N-1\)/N·S\s+=\s+42\.00 GB", text)
    assert "2.00x" in text


@pytest.mark.parametrize("argv", [
    [], ["--gpus", "1"], ["--gpus", "x"], ["--gpus", "3", "--size", "3 parsecs"],
    ["--gpus", "3", "--size", "0GB"], ["--gpus", "3", "--bogus"]])
def test_main_ring_bad_input(argv, capsys):
    assert main_ring(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerotrain ring: error:") and err.count("\n") == 1


def test_parse_size():
    def size(text: str) -> tuple[int, bool]:
        return parse_size(text, "--size", bare_unit="B")

    assert size("28GB") == (28 * 10**9, False)
    assert size("1.5GiB") == (3 * 2**29, True)
    assert size("512 kb") == (512_000, False)
    assert size("4096") == (4096, False)


@pytest.mark.slow
def test_main_ring_run_two_processes(capsys):
    assert main_ring(["--gpus", "2", "--size", "1MB", "--run"]) == 0
    out = capsys.readouterr().out
    assert "PASS: ring all-reduce equals dist.all_reduce" in out
    assert out.count(" ok\n") == 2


def test_classic_example_128_gpus(capsys):
    """28 GB of fp32 gradients (7B parameters) on 128 GPUs: naive all-to-one puts
    127 × 28 = 3556 GB on GPU0's link; the ring sends 2·127/128 × 28 = 55.5625 GB per GPU."""
    assert main_ring(["--gpus", "128", "--size", "28GB"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"naive all-to-one.*=\s+3556\.00 GB on the busiest link", text)
    assert re.search(r"naive exchange.*=\s+3556\.00 GB sent per rank", text)
    assert re.search(r"ring\s+2\(N-1\)/N·S\s+=\s+55\.56 GB sent per rank", text)
    assert "64.00x" in text
    assert "skipped" in text and not _tables(text)


@pytest.mark.parametrize("n", [26, 27, 1000])
def test_tables_while_there_are_letters(n, capsys):
    assert main_ring(["--gpus", str(n), "--size", "1MB"]) == 0
    text = capsys.readouterr().out
    assert len(_tables(text)) == (1 + 2 * (n - 1) if n <= 26 else 0)
    assert ("skipped" in text) == (n > 26)
    assert f"= {n / 2:.2f}x" in text


@pytest.mark.parametrize("nbytes", [0, 1, 5, 999, 1000, 28 * 10**9 + 7])
@pytest.mark.parametrize("n", [2, 3, 7, 26, 27])
def test_busiest_rank(nbytes, n):
    assert busiest_ring_bytes(nbytes, n) == max(ring_bytes(nbytes, n, r)[0] for r in range(n))
