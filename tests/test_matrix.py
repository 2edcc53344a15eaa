"""The combination matrix, quick form (issue 29, item 2; the full form is bench/matrix.py).

The ZeRO stage against every other option (and the FP8 recipe against the FP8 wire,
ZeRO++'s parameter wire, hpZ and qgZ against each other):
every valid pair of their values in a 3-step run on 2 ranks that equals its reference
(tests/matrix_run.py says which reference and tolerance each option gets), and every
refused pair refused at config time in one line naming both settings.
"""

from __future__ import annotations

import pytest

import matrix_plan as mp
import matrix_run as mr

from multirank import run_ranks


def test_cover_covers_every_valid_pair_and_is_deterministic():
    for required in (mp.QUICK, mp.FULL):
        rows = mp.cover(required)
        need, got = mp.covered(rows, required)
        assert need == got > 0
        assert rows == mp.cover(required)
        assert all(mp.valid(r) for r in rows)
    # the generator is greedy, not exhaustive: far below the 248,832 full combinations
    assert len(mp.cover(mp.FULL)) <= 30
    # independently of the plan's own pair bookkeeping: every valid pair, by brute force
    full = mp.cover(mp.FULL)
    names = list(mp.FACTORS)
    for i, f in enumerate(names):
        for g in names[i + 1 :]:
            for u in mp.FACTORS[f]:
                for v in mp.FACTORS[g]:
                    if ((f, u), (g, v)) in mp.REFUSED:
                        assert not any(r[f] == u and r[g] == v for r in full), (f, u, g, v)
                    else:
                        assert any(r[f] == u and r[g] == v for r in full), (f, u, g, v)
    # a pair the plan refuses is never trained, and the check sees one missing pair
    rows = mp.cover(mp.QUICK)
    assert not any(r["stage"] != 3 and r["tier"] != "none" for r in rows)
    need, got = mp.covered(rows[:-1], mp.QUICK)
    assert got < need


@pytest.mark.parametrize("pair", list(mp.REFUSED), ids=str)
def test_refused_pairs_fail_at_config_time_in_one_line_naming_both(pair):
    a, b = pair
    row = mp.refusal_row(a, b)
    msg = mr.refusal(row)
    assert msg is not None, f"{a} with {b} is not refused"
    assert "\n" not in msg, msg
    for factor, level in (a, b):
        assert mp.setting(factor, level) in msg, (factor, msg)
    # and the refusal is this pair's: either half alone builds
    plain = {f: v[0] for f, v in mp.FACTORS.items()}
    for half in (a, b):
        alone = {**plain, half[0]: half[1]}
        if half[0] == "wire" and half[1] == "fp8":
            alone.update(stage=3, fp8="tensorwise")
        elif half[0] in ("tier", "wire", "hpz", "gwire") and half[1] not in ("none", "plain", None):
            alone["stage"] = 3
        elif half[0] == "offload" and half[1] == "cpu":
            alone["stage"] = 2
        assert mr.refusal(alone) is None, half


def test_the_wires_two_spellings_are_refused_in_one_line():
    for r in mr.alias_refusals():
        assert r["ok"], r


def test_stage_against_every_option_equals_its_reference():
    rows = mp.cover(mp.QUICK)
    results = run_ranks(mr.run_rows, mr.WORLD, rows, "fp8", timeout=600)
    for rank_results in results:
        bad = [mr.judge(r, res) for r, res in zip(rows, rank_results, strict=True)]
        bad = [v for v in bad if not v["ok"]]
        assert not bad, bad
    # and the references' anchor: the plain run on 2 ranks is one process's
    plain = {f: v[0] for f, v in mp.FACTORS.items()}
    assert rows[0] == plain
    assert mr.deviation(mr.train_row(plain), results[0][0]["ref"]) <= mr.TOL["reduce"]
