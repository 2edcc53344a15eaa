"""`zerotrain lr-find` (issue 15): the ramp, the smoothing and stop rules against slow
reference implementations, a real range test that diverges and stops, the suggestion's
direction when the model is made much wider, two ranks against one, and bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zerotrain.cli import main
from zerotrain.config import build_config
from zerotrain.run.lr_find import DIVERGE_FACTOR, RangeTest, beta_for, lr_find, ramp_lr

TESTS = Path(__file__).parent


# ----------------------------------------------------------------------------- rules


def test_ramp_is_geometric_from_start_to_end():
    ref = np.geomspace(1e-5, 2.0, 37)
    got = [ramp_lr(s, 1e-5, 2.0, 37) for s in range(37)]
    np.testing.assert_allclose(got, ref, rtol=1e-12)


def _reference_smoothing(losses: list[float], beta: float) -> list[float]:
    """Bias-corrected EMA written as the weighted mean it is."""
    out = []
    for t in range(1, len(losses) + 1):
        w = [(1 - beta) * beta ** (t - 1 - i) for i in range(t)]
        out.append(sum(wi * x for wi, x in zip(w, losses[:t])) / sum(w))
    return out


def _reference_zero_lag(losses: list[float], beta: float) -> list[float]:
    forward = _reference_smoothing(losses, beta)
    return _reference_smoothing(forward[::-1], beta)[::-1]


def test_smoothing_stop_and_suggestion_match_a_reference():
    rng = np.random.default_rng(0)
    # falls, flattens, then climbs steeply: a range test's shape, with noise
    losses = [5.0 - 3.0 * min(i, 30) / 30 + max(0, i - 40) ** 2 * 0.05 + rng.normal(0, 0.05)
              for i in range(80)]
    beta = beta_for(80)
    assert beta == pytest.approx(0.875)  # remembers 8 of the 80 steps
    ref = _reference_smoothing(losses, beta)
    stop = next(i for i in range(len(ref)) if ref[i] > DIVERGE_FACTOR * min(ref[:i + 1]))
    test = RangeTest(beta=beta)
    lrs = [ramp_lr(i, 1e-4, 1.0, 80) for i in range(80)]
    stopped_at = next(i for i in range(80) if test.add(lrs[i], losses[i]))
    assert stopped_at == stop < 79
    assert "exceeds 2x its lowest value" in test.stop_reason
    np.testing.assert_allclose(test.smoothed, ref[:stop + 1], rtol=1e-12)
    z = _reference_zero_lag(losses[:stop + 1], beta)
    np.testing.assert_allclose(test.zero_lag(), z, rtol=1e-12)
    best = int(np.argmin(z))
    threshold = z[best] + 0.05 * (z[0] - z[best])
    valley = min(i for i in range(len(z)) if z[i] <= threshold)
    assert test.best_index() == best and 20 <= valley < best
    assert test.suggestion() == lrs[valley]


def test_the_lag_free_curve_finds_the_minimum_where_it_is():
    # a noiseless bowl in log lr with its bottom at step 50: the running average's minimum
    # lands several steps late, the forward-backward one at the bottom
    losses = [3.0 + 0.002 * (i - 50) ** 2 for i in range(100)]
    test = RangeTest(beta=beta_for(100))
    for i, loss in enumerate(losses):
        if test.add(ramp_lr(i, 1e-5, 1.0, 100), loss):
            break
    assert int(np.argmin(test.smoothed)) >= 55
    assert abs(test.best_index() - 50) <= 1


def test_nonfinite_loss_stops_and_rising_loss_gives_no_suggestion():
    t = RangeTest()
    assert not t.add(1e-3, 3.0) and t.add(1e-2, math.nan)
    assert "nan" in t.stop_reason
    rising = RangeTest()
    for i in range(10):
        rising.add(10.0 ** (i - 5), 3.0 + 0.01 * i)
    assert rising.best_index() is None and rising.suggestion() is None


# ----------------------------------------------------------------------------- real runs


def _corpus(tmp_path: Path) -> str:
    import zerotrain.engine as eng_mod

    p = tmp_path / "corpus.txt"
    p.write_text(Path(eng_mod.__file__).read_text() * 3)
    return str(p)


def _cfg(tmp_path: Path, width: int = 32, run: str = "run", **extra):
    d = {
        "model": {"n_layer": 1, "n_head": 2, "n_embd": width, "block_size": 32},
        "data": {"path": _corpus(tmp_path), "micro_batch_size": 4},
        "schedule": {"warmup_steps": 0},
        "checkpoint": {"every": 2},
        "logging": {"run_dir": str(tmp_path / run), "progress": False},
        "train": {"steps": 10, "threads": 1, "seed": 1337},
    }
    for k, v in extra.items():
        d.setdefault(k, {}).update(v)
    return build_config(d)


RAMP = dict(start_lr=1e-4, end_lr=10.0, steps=40)


def test_range_test_diverges_stops_and_leaves_the_run_folder_alone(tmp_path, capsys):
    run, ckpts = tmp_path / "run", tmp_path / "ckpts"
    (ckpts / "step_00000002").mkdir(parents=True)  # the run's checkpoint.dir
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"type": "train", "step": 1}\n')  # another run's
    cfg = _cfg(tmp_path, checkpoint={"dir": str(ckpts)})
    r = lr_find(cfg, **RAMP)
    out = capsys.readouterr().out
    assert r["diverged"] and r["steps_run"] < RAMP["steps"]
    assert len(r["losses"]) == r["steps_run"] - 1  # the first loss is the untrained model's
    assert r["smoothed"] == pytest.approx(_reference_zero_lag(r["losses"][:len(r["smoothed"])],
                                                              r["beta"]), rel=1e-12)
    assert r["beta"] == beta_for(RAMP["steps"]) == 0.75
    # the valley's start is at or before its lowest point (the same one in a sharp valley)
    assert r["suggested_lr"] <= r["lr_at_min"] == r["lrs"][int(np.argmin(r["smoothed"]))]
    # the engine used the ramp: each logged step's lr is the ramp's
    recs = [json.loads(x) for x in (run / "lr-find" / "metrics.jsonl").read_text().splitlines()
            if x]
    np.testing.assert_allclose([x["lr"] for x in recs],
                               [ramp_lr(x["step"] - 1, **RAMP) for x in recs], rtol=1e-12)
    assert json.loads((run / "lr-find" / "lr_find.json").read_text()) == r
    assert (run / "lr-find" / "lr_find.png").stat().st_size > 1000
    assert f"suggested peak lr {r['suggested_lr']:.3g} (configured optimizer.lr 0.001)" in out
    assert "rule: the start of the valley, the smallest lr at which" in out
    assert f"stopped after {r['steps_run']} of 40 steps" in out
    # nothing saved, the run folder untouched; a second test replaces the first
    assert (run / "metrics.jsonl").read_text() == '{"type": "train", "step": 1}\n'
    assert [p.name for p in ckpts.iterdir()] == ["step_00000002"]
    assert not (run / "checkpoints").exists() and not (run / "lr-find" / "checkpoints").exists()
    assert lr_find(cfg, **RAMP)["losses"] == r["losses"]  # same seed, same test


def test_a_much_wider_model_gets_a_lower_suggestion(tmp_path):
    narrow = lr_find(_cfg(tmp_path, 32, "narrow"), **RAMP)
    wide = lr_find(_cfg(tmp_path, 256, "wide"), **RAMP)
    assert narrow["suggested_lr"] is not None and wide["suggested_lr"] is not None
    # Adam's stable step shrinks as fan-in grows; 8x the width: a clearly lower edge
    assert wide["suggested_lr"] < narrow["suggested_lr"]
    assert wide["lr_at_min"] < narrow["lr_at_min"]


def test_two_ranks_zero2_match_one_rank(tmp_path):
    corpus = _corpus(tmp_path)
    flags = ["--data.path", corpus, "--model.n_layer", "1", "--model.n_embd", "32",
             "--model.n_head", "2", "--model.block_size", "32", "--data.micro_batch_size",
             "4", "--schedule.warmup_steps", "0", "--train.steps", "10",
             "--logging.progress", "false", "--start-lr", "1e-4", "--end-lr", "10",
             "--steps", "20"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(TESTS.parent / "src"), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    two = subprocess.run([sys.executable, "-m", "zerotrain", "lr-find", "--nproc", "2",
                          "--zero.stage", "2", "--logging.run_dir", str(tmp_path / "two"),
                          *flags], capture_output=True, text=True, env=env, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("suggested peak lr") == 1  # rank 0 speaks for the job
    assert "2 rank(s), zero2" in two.stdout
    r2 = json.loads((tmp_path / "two" / "lr-find" / "lr_find.json").read_text())
    # one process accumulating 2 micro-batches takes the same global batch as 2 ranks
    assert main(["lr-find", "--logging.run_dir", str(tmp_path / "one"),
                 "--data.grad_accum_steps", "2", *flags]) == 0
    r1 = json.loads((tmp_path / "one" / "lr-find" / "lr_find.json").read_text())
    # the same global batch at any world size: the same curve, up to summation order —
    # which a diverging run (lr near 10, loss far above its start) amplifies, so the
    # points past the bottom of the valley are compared more loosely
    assert r2["lrs"] == r1["lrs"] and r2["steps_run"] == r1["steps_run"]
    stable = int(np.argmin(r1["losses"])) + 1  # up to the bottom of the valley
    np.testing.assert_allclose(r2["losses"][:stable], r1["losses"][:stable], rtol=1e-5)
    # past it, one reordered sum grows ~100x per step of divergence (2e-3 measured at
    # the last points with 1 rank x 2 micro-batches against 2 ranks)
    np.testing.assert_allclose(r2["losses"], r1["losses"], rtol=1e-2)
    assert r2["suggested_lr"] == r1["suggested_lr"]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("argv, message", [
    (["--steps", "9"], "--steps must be at least 10"),
    (["--steps", "ten"], "--steps 'ten' is not a count"),
    (["--steps", "20.5"], "--steps must be a whole number"),
    (["--start-lr", "0"], "--start-lr must be a positive number"),
    (["--start-lr", "abc"], "--start-lr 'abc' is not a number"),
    (["--end-lr", "1e-6"], "--end-lr (1e-06) must be larger than --start-lr (1e-05)"),
    (["--end-lr", "inf"], "--end-lr must be a finite number"),
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--steps"], "--steps needs a value"),
    (["--optimizer.lrr", "3"], "unknown config key 'optimizer.lrr'"),
    (["--resume"], "--resume is a train option"),
])
def test_bad_input_is_one_error_line(argv, message, capsys, tmp_path):
    code = main(["lr-find", "--logging.run_dir", str(tmp_path / "r"), *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zerotrain lr-find: error: "), err
    assert message in lines[0]
    assert not (tmp_path / "r").exists()  # refused before anything was built
