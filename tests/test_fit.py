"""Run output (issue 15): the fit diagnosis on synthetic curves, the train–validation gap
and the lr drawn from the schedule in curves.png, and the one line per periodic save."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

import zerotrain.run.report
from zerotrain.config import build_config
from zerotrain.optim.schedule import lr_at
from zerotrain.run.curves import curve_series
from zerotrain.run.fit import TOLERANCE, diagnose, pair_evaluations, verdict
from zerotrain.run.loop import train


def records(train_loss, val_loss, steps=1000, log_every=10, eval_every=100):
    """Metric records of a run whose losses follow the given functions of the step."""
    out = []
    for s in range(1, steps + 1):
        if s % log_every == 0:
            out.append({"type": "train", "step": s, "loss": train_loss(s)})
    for s in range(0, steps + 1, eval_every):
        out.append({"type": "val", "step": s, "val_loss": val_loss(s)})
    return out


# train always falls; validation as named
CURVES = {
    "under-fit": (lambda s: 2 + 3 * math.exp(-s / 400), lambda s: 2.2 + 3 * math.exp(-s / 400)),
    "well fit": (lambda s: 2 + 3 * math.exp(-s / 400), lambda s: 2.3 + 3 * math.exp(-s / 60)),
    "over-fit": (lambda s: 2 + 3 * math.exp(-s / 400), lambda s: 2.5 + 1e-6 * (s - 500) ** 2),
    "unstable": (lambda s: 2 + 1e-3 * s, lambda s: 2.2 + 1e-3 * s),
}


@pytest.mark.parametrize("expected", list(CURVES))
def test_verdict_on_synthetic_curves(expected):
    fit = diagnose(records(*CURVES[expected]))
    assert fit.verdict == expected
    assert fit.evaluations == 3 and (fit.first_step, fit.last_step) == (800, 1000)
    assert expected.split()[0] in fit.line()


def test_trends_and_gap_match_a_least_squares_reference():
    tr_fn, va_fn = CURVES["over-fit"]
    recs = records(tr_fn, va_fn)
    fit = diagnose(recs)
    steps = np.array([800, 900, 1000])
    # independent pairing: mean of the later five of the ten training losses in each window
    tr = np.array([np.mean([tr_fn(s) for s in range(e - 40, e + 1, 10)]) for e in steps])
    va = np.array([va_fn(s) for s in steps])
    span = 200
    assert fit.train_trend == pytest.approx(np.polyfit(steps, tr, 1)[0] * span / tr.mean(),
                                            rel=1e-9)
    assert fit.val_trend == pytest.approx(np.polyfit(steps, va, 1)[0] * span / va.mean(),
                                          rel=1e-9)
    assert fit.gap == pytest.approx(va[-1] - tr[-1], rel=1e-12)
    assert fit.gap_change == pytest.approx(np.polyfit(steps, va - tr, 1)[0] * span, rel=1e-9)
    assert "widening" in fit.gap_text() and "steps 800–1000" in fit.gap_text()
    rec = fit.record()
    assert rec["fit"] == "over-fit" and rec["train_val_gap"] == fit.gap


def test_pairing_windows_and_too_few_evaluations():
    recs = records(lambda s: float(s), lambda s: 100.0 + s, steps=10, log_every=1,
                   eval_every=5)
    steps, tr, va = pair_evaluations(recs)
    assert steps == [5, 10]  # the step-0 evaluation has no training before it
    assert tr == [4.0, 9.0] and va == [105.0, 110.0]  # means of 3..5 and 8..10
    fit = diagnose(recs)
    assert fit.verdict == "unknown" and "not enough evaluations" in fit.line()
    assert "needs more evaluations" in fit.gap_text()


def test_tolerance_edges():
    assert verdict(-0.5, -TOLERANCE * 1.01) == "under-fit"
    assert verdict(-0.5, -TOLERANCE * 0.99) == "well fit"
    assert verdict(-0.5, TOLERANCE * 0.99) == "well fit"
    assert verdict(TOLERANCE * 0.99, TOLERANCE * 1.01) == "over-fit"
    assert verdict(TOLERANCE * 1.01, TOLERANCE * 1.01) == "unstable"


def test_gap_steady_and_narrowing():
    flat = diagnose(records(lambda s: 2.0 + 1e-4 * (s % 7), lambda s: 2.1))
    assert "steady" in flat.gap_text()
    closing = diagnose(records(lambda s: 2.0, lambda s: 2.0 + 300 / (s + 1)))
    assert "narrowing" in closing.gap_text() and closing.gap_change < 0


def test_curve_series_lr_is_the_schedule_at_every_step():
    kw = dict(peak_lr=3e-3, total_steps=20, warmup_steps=7, min_lr=3e-4)
    recs = [{"type": "train", "step": s, "loss": 1.0, "lr": lr_at(s - 1, **kw)}
            for s in range(5, 21, 5)]
    series = curve_series(recs, lambda s: lr_at(s, **kw), 20)
    xs, ys = series["lr_schedule"]
    assert xs == list(range(1, 21))
    assert ys == [lr_at(x - 1, **kw) for x in xs]
    assert max(ys) == pytest.approx(3e-3, rel=1e-12)
    assert max(series["lr_logged"][1]) < 0.97 * 3e-3  # what the logged points alone show


# ----------------------------------------------------------------------------- a real run


def _tiny(tmp_path: Path):
    import zerotrain.engine as eng_mod

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(eng_mod.__file__).read_text() * 3)
    return build_config({
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
        "data": {"path": str(corpus), "micro_batch_size": 4},
        "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": 4, "min_lr": 3e-4},
        "checkpoint": {"every": 3, "keep": 5},
        "logging": {"run_dir": str(tmp_path / "run"), "log_every": 3, "eval_every": 2,
                    "sample_tokens": 0, "progress": False, "plot": True},
        "train": {"steps": 8, "threads": 1},
    })


def test_run_output_gap_fit_curves_and_checkpoint_lines(tmp_path, monkeypatch, capsys):
    drawn = {}
    real = zerotrain.run.report.plot_curves

    def spy(series, path, *a):
        drawn.update(series)
        real(series, path, *a)

    monkeypatch.setattr(zerotrain.run.report, "plot_curves", spy)
    cfg = _tiny(tmp_path)
    summary = train(cfg)
    out = capsys.readouterr().out
    # periodic saves: one line each, naming a checkpoint that exists
    saves = re.findall(r"^\[zerotrain\] step (\d+): checkpoint (\S+)$", out, re.M)
    assert [s for s, _ in saves] == ["3", "6"]
    assert all(Path(p).is_dir() and Path(p).name == f"step_{int(s):08d}" for s, p in saves)
    # the lr panel is the schedule: its peak shows although no logged step carries it
    xs, ys = drawn["lr_schedule"]
    assert xs == list(range(1, 9)) and max(ys) == pytest.approx(3e-3, rel=1e-12)
    assert max(drawn["lr_logged"][1]) < 0.9 * 3e-3
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000
    # the gap: evaluations at 4, 6, 8 pair with the training losses logged at 3, 6, 8
    recs = [r for r in _jsonl(tmp_path / "run" / "metrics.jsonl")]
    loss = {r["step"]: r["loss"] for r in recs if r["type"] == "train"}
    val = {r["step"]: r["val_loss"] for r in recs if r["type"] == "val"}
    gaps = [val[4] - loss[3], val[6] - loss[6], val[8] - loss[8]]
    assert drawn["gap"] == ([4, 6, 8], pytest.approx(gaps, rel=1e-12))
    assert summary["train_val_gap"] == pytest.approx(gaps[-1], rel=1e-12)
    assert summary["fit"] in ("under-fit", "well fit", "over-fit", "unstable")
    assert recs[-1]["type"] == "summary" and recs[-1]["fit"] == summary["fit"]
    final = [ln for ln in out.splitlines() if ln.startswith("[zerotrain] validation loss")]
    assert len(final) == 1 and f"gap val − train {gaps[-1]:+.3f}" in final[0]
    assert f"[zerotrain] fit: {summary['fit']} — over the last 3 evaluations" in out


def _jsonl(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
