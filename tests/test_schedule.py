"""Learning-rate schedule: phase boundaries, exact resume, validation (CLI: test_cli_schedule)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from zerotrain.config import ScheduleConfig
from zerotrain.optim import AdamW
from zerotrain.optim.schedule import WarmupDecayLR, key_points, lr_at, lr_from_config

PEAK, MIN, TOTAL = 1e-3, 1e-4, 1000


def lr(step: int, **kw) -> float:
    kw.setdefault("peak_lr", PEAK)
    kw.setdefault("total_steps", TOTAL)
    kw.setdefault("min_lr", MIN)
    return lr_at(step, **kw)


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant", "wsd"])
def test_warmup_is_linear_from_start_value(kind):
    kw = dict(kind=kind, warmup_steps=100, warmup_start_lr=1e-5)
    assert lr(0, **kw) == pytest.approx(1e-5)
    assert lr(50, **kw) == pytest.approx(1e-5 + (PEAK - 1e-5) / 2)
    assert lr(100, **kw) == pytest.approx(PEAK)
    assert lr(0, kind=kind, warmup_steps=100) == 0.0  # default start: 0
    assert lr(1, kind=kind, warmup_steps=100) == pytest.approx(PEAK / 100)


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_hold_then_decay_to_min(kind):
    kw = dict(kind=kind, warmup_steps=100, hold_steps=100)  # decay: steps 200..1000
    assert lr(150, **kw) == PEAK and lr(200, **kw) == PEAK
    assert lr(600, **kw) == pytest.approx((PEAK + MIN) / 2)  # both are symmetric at half
    assert lr(1000, **kw) == pytest.approx(MIN)
    assert lr(5000, **kw) == MIN  # beyond the end: the floor
    decay = [lr(s, **kw) for s in range(200, 1001)]
    assert all(a > b for a, b in itertools.pairwise(decay))


def test_cosine_and_linear_shapes():
    quarter = 200 + 200  # a quarter of the way through decay 200..1000
    kw = dict(warmup_steps=100, hold_steps=100)
    cos = lr(quarter, kind="cosine", **kw)
    assert cos == pytest.approx(MIN + (PEAK - MIN) * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr(quarter, kind="linear", **kw) == pytest.approx(MIN + (PEAK - MIN) * 0.75)


def test_decay_steps_shortens_decay():
    kw = dict(warmup_steps=10, decay_steps=90)  # decay 10..100, then floor
    assert lr(55, **kw) == pytest.approx((PEAK + MIN) / 2)
    assert lr(100, **kw) == pytest.approx(MIN) and lr(500, **kw) == MIN


def test_constant_never_decays():
    kw = dict(kind="constant", warmup_steps=10)
    assert lr(10, **kw) == PEAK and lr(999, **kw) == PEAK and lr(10**6, **kw) == PEAK


def test_wsd_stable_then_sqrt_cooldown():
    kw = dict(kind="wsd", warmup_steps=100, wsd_decay_fraction=0.2)  # decay 820..1000
    assert lr(100, **kw) == PEAK and lr(819, **kw) == PEAK and lr(820, **kw) == PEAK
    assert lr(865, **kw) == pytest.approx(MIN + (PEAK - MIN) * (1 - math.sqrt(0.25)))
    assert lr(1000, **kw) == pytest.approx(MIN)
    assert lr(820, kind="wsd", warmup_steps=100, decay_steps=100) == PEAK
    assert lr(950, kind="wsd", warmup_steps=100, decay_steps=100) == pytest.approx(
        MIN + (PEAK - MIN) * (1 - math.sqrt(0.5)))


def test_zero_warmup_starts_at_peak():
    assert lr(0) == PEAK


@pytest.mark.parametrize(("kw", "field"), [
    (dict(step=-1), "step"),
    (dict(total_steps=0), "total_steps"),
    (dict(peak_lr=0.0), "peak_lr"),
    (dict(min_lr=2e-3), "min_lr"),
    (dict(warmup_start_lr=-1.0), "warmup_start_lr"),
    (dict(warmup_steps=900, hold_steps=200), "exceed total_steps"),
    (dict(decay_steps=0), "decay_steps"),
    (dict(kind="exponential"), "kind"),
    (dict(kind="wsd", wsd_decay_fraction=0.0), "wsd_decay_fraction"),
    (dict(kind="wsd", hold_steps=5), "hold_steps"),
])
def test_bad_arguments_name_the_field(kw, field):
    step = kw.pop("step", 0)
    with pytest.raises(ValueError, match=field):
        lr(step, **kw)


def test_lr_from_config_matches_lr_at():
    cfg = ScheduleConfig(kind="linear", warmup_steps=20, hold_steps=5, min_lr=1e-5,
                         warmup_start_lr=1e-6)
    for s in (0, 7, 20, 24, 25, 60, 100, 200):
        assert lr_from_config(s, cfg, 3e-4, 100) == lr_at(
            s, peak_lr=3e-4, total_steps=100, kind="linear", warmup_steps=20, hold_steps=5,
            min_lr=1e-5, warmup_start_lr=1e-6)


def _opt(lrs=(PEAK,)) -> AdamW:
    return AdamW([{"params": [torch.zeros(2)], "lr": x} for x in lrs])


def _run(sched: WarmupDecayLR, opt, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_lr_scheduler_follows_lr_at_and_resumes_exactly_mid_warmup():
    kw = dict(total_steps=60, warmup_steps=20, hold_steps=5, min_lr=MIN, kind="cosine")
    opt = _opt()
    sched = WarmupDecayLR(opt, **kw)
    full = _run(sched, opt, 60)
    assert full == [lr_at(s, peak_lr=PEAK, **kw) for s in range(60)]
    # interrupted at step 7 (mid-warmup): only the step travels in the checkpoint
    opt = _opt()
    sched = WarmupDecayLR(opt, **kw)
    first = _run(sched, opt, 7)
    state = sched.state_dict()
    assert state == {"step": 7}
    opt2 = _opt()
    sched2 = WarmupDecayLR(opt2, **kw)
    sched2.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == full[7]
    assert first + _run(sched2, opt2, 53) == full


def test_lr_scheduler_keeps_group_ratios():
    opt = _opt((PEAK, PEAK / 10))
    sched = WarmupDecayLR(opt, total_steps=100, warmup_steps=10, min_lr=MIN)
    for _ in range(30):
        opt.step()
        sched.step()
    a, b = (g["lr"] for g in opt.param_groups)
    assert a == lr_at(30, peak_lr=PEAK, total_steps=100, warmup_steps=10, min_lr=MIN)
    assert b == pytest.approx(a / 10)


def test_lr_scheduler_from_config_validates():
    with pytest.raises(ValueError, match="exceed total_steps"):
        WarmupDecayLR.from_config(_opt(), ScheduleConfig(warmup_steps=500), total_steps=100)


def test_key_points():
    pts = dict(key_points(1000, kind="cosine", warmup_steps=100, hold_steps=50))
    assert pts == {"start": 0, "end of warmup": 100, "end of hold": 150, "mid-decay": 575,
                   "end of decay": 1000}
