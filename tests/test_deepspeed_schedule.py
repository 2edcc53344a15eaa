"""DeepSpeed's schedulers mapped onto zerotrain's schedule: lr curves against DeepSpeed's
formulas transcribed from its documented schedulers, the schedule additions they needed
(log warmup, decay_start), and a DeepSpeed config trained end to end."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ds_reference import curve, ds_warmup_cosine_lr, ds_warmup_decay_lr, ds_warmup_lr
from zerotrain.config import ConfigError, build_config
from zerotrain.deepspeed_config import load_any_config, load_deepspeed_config
from zerotrain.optim.schedule import describe, lr_at, schedule_kwargs

DS = Path(__file__).parent / "data" / "ds"


# ----------------------------------------------------------------------------- lr curves

WARMUPS = [1, 2, 7, 50]


@pytest.mark.parametrize("wtype", ["log", "linear"])
@pytest.mark.parametrize("warmup", WARMUPS)
def test_warmuplr_curve_matches_deepspeed(wtype, warmup):
    lo, hi = 2e-5, 7e-4
    cfg = load_deepspeed_config({"train_micro_batch_size_per_gpu": 1,
                                 "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                                 "scheduler": {"type": "WarmupLR", "params": {
                                     "warmup_min_lr": lo, "warmup_max_lr": hi,
                                     "warmup_num_steps": warmup, "warmup_type": wtype}}})
    w = max(2, warmup)
    steps = range(0, 3 * w + 20)
    want = [ds_warmup_lr(s, lo, hi, w, wtype) for s in steps]
    assert curve(cfg, steps) == pytest.approx(want, rel=1e-12, abs=1e-18)
    assert max(curve(cfg, steps)) == hi == cfg.optimizer.lr  # the peak is exact


@pytest.mark.parametrize("wtype", ["log", "linear"])
@pytest.mark.parametrize("warmup,total", [(1, 30), (2, 3), (7, 100), (50, 333)])
def test_warmupdecaylr_curve_matches_deepspeed(wtype, warmup, total):
    lo, hi = 1e-6, 3e-4
    cfg = load_deepspeed_config({"train_micro_batch_size_per_gpu": 1,
                                 "scheduler": {"type": "WarmupDecayLR", "params": {
                                     "warmup_min_lr": lo, "warmup_max_lr": hi,
                                     "warmup_num_steps": warmup, "total_num_steps": total,
                                     "warmup_type": wtype}}})
    steps = range(0, total + 25)  # past the end too: DeepSpeed holds warmup_min_lr
    want = [ds_warmup_decay_lr(s, lo, hi, max(2, warmup), total, wtype) for s in steps]
    assert curve(cfg, steps) == pytest.approx(want, rel=1e-12, abs=1e-18)
    assert cfg.train.steps == total and cfg.optimizer.lr == hi


@pytest.mark.parametrize("wtype", ["log", "linear"])
@pytest.mark.parametrize("warmup,total,r0,rc", [(1, 40, 0.0, 1e-4), (5, 6, 0.2, 0.0),
                                                (30, 300, 0.1, 0.05), (64, 1000, 0.0, 0.3)])
def test_warmupcosinelr_curve_matches_deepspeed(wtype, warmup, total, r0, rc):
    lr = 4e-4
    cfg = load_deepspeed_config({"train_micro_batch_size_per_gpu": 1,
                                 "optimizer": {"type": "AdamW", "params": {"lr": lr}},
                                 "scheduler": {"type": "WarmupCosineLR", "params": {
                                     "warmup_num_steps": warmup, "total_num_steps": total,
                                     "warmup_min_ratio": r0, "cos_min_ratio": rc,
                                     "warmup_type": wtype}}})
    steps = range(0, total + 25)
    want = [ds_warmup_cosine_lr(s, lr, max(2, warmup), total, r0, rc, wtype) for s in steps]
    assert curve(cfg, steps) == pytest.approx(want, rel=1e-12, abs=1e-18)
    assert cfg.optimizer.lr == lr  # WarmupCosineLR's peak is the optimizer's lr


def test_example_files_curves_match_deepspeed():
    cfg = load_deepspeed_config(DS / "stage2_fp16_offload_cosine.json", world_size=2)
    steps = range(0, 320)
    want = [ds_warmup_cosine_lr(s, 2e-4, 30, 300, 0.1, 0.05, "log") for s in steps]
    assert curve(cfg, steps) == pytest.approx(want, rel=1e-12)
    cfg = load_deepspeed_config(DS / "stage1_bf16_warmupdecay.json", world_size=4)
    want = [ds_warmup_decay_lr(s, 0.0, 3e-4, 40, 400, "linear") for s in steps]
    assert curve(cfg, steps) == pytest.approx(want, rel=1e-12, abs=1e-18)


def test_log_warmup_and_decay_start_in_lr_at():
    # log warmup: 0 -> peak along log(s+1)/log(W), reaching the peak at W−1
    kw = dict(peak_lr=1.0, total_steps=100, kind="constant", warmup_steps=10,
              warmup_type="log")
    assert lr_at(0, **kw) == 0.0 and lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(3, **kw) == pytest.approx(math.log(4) / math.log(10))
    # decay_start one step before the end of warmup: the cosine's first post-warmup value
    # is one step in; the warmup still owns every step before warmup_steps
    kw = dict(peak_lr=1.0, total_steps=100, kind="cosine", warmup_steps=10, min_lr=0.0,
              decay_start=9, decay_steps=90)
    assert lr_at(9, **kw) == pytest.approx(0.9)  # linear warmup, not the decay
    assert lr_at(10, **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi / 90)))
    assert lr_at(99, **kw) == 0.0
    with pytest.raises(ValueError, match="log"):
        lr_at(0, peak_lr=1.0, total_steps=10, warmup_steps=1, warmup_type="log")
    with pytest.raises(ValueError, match="decay_start"):
        lr_at(0, peak_lr=1.0, total_steps=10, kind="wsd", decay_start=3)


def test_schedule_config_refuses_meaningless_combinations():
    with pytest.raises(ConfigError, match="warmup_type log needs"):
        build_config({"schedule": {"warmup_type": "log", "warmup_steps": 1}})
    with pytest.raises(ConfigError, match="decay_start applies to kind cosine or linear"):
        build_config({"schedule": {"kind": "constant", "decay_start": 3}})
    with pytest.raises(ConfigError, match="hold_steps 0"):
        build_config({"schedule": {"hold_steps": 5, "decay_start": 3}})
    with pytest.raises(ConfigError, match="warmup_start_lr"):
        build_config({"optimizer": {"lr": 1e-4}, "schedule": {"warmup_start_lr": 1e-3}})


def test_describe_names_each_phase():
    cfg = load_deepspeed_config(DS / "stage2_fp16_offload_cosine.json", world_size=2)
    line = describe(cfg.optimizer.lr, cfg.train.steps, **schedule_kwargs(cfg.schedule))
    assert line == ("lr: log warmup 2e-05 -> 0.0002 over 30 steps, cosine decay from step 29 "
                    "to 1e-05 at step 299")
    lib = load_any_config(None)
    assert describe(lib.optimizer.lr, lib.train.steps, **schedule_kwargs(lib.schedule)) == \
        "lr: constant 0.001"


# ----------------------------------------------------------------------------- end to end


def test_engine_trains_a_deepspeed_config_as_deepspeed_would():
    """Independent reference: torch.optim.AdamW over every parameter (DeepSpeed decays all
    it is given), clip_grad_norm_ and DeepSpeed's WarmupCosineLR formula, on a copy."""
    import copy

    import torch

    import zerotrain
    from zerotrain.models.gpt import GPT

    from zero_harness import BASE, GLOBAL_BATCH, batches, rel_err

    ds = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH, "gradient_clipping": 0.3,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1}},
          "scheduler": {"type": "WarmupCosineLR", "params": {
              "warmup_num_steps": 3, "total_num_steps": 10, "warmup_min_ratio": 0.1}}}
    cfg = load_deepspeed_config(ds, 1, {"model": BASE["model"], "train": {"device": "cpu"},
                                        "comm": {"algorithm": "native"}})
    torch.manual_seed(0)
    model = GPT(cfg.model)
    ref = copy.deepcopy(model)
    engine = zerotrain.initialize(model, cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.1, foreach=False)
    for s, (x, y) in enumerate(batches(10)):
        engine.backward(engine(x, y))
        engine.step()
        ref(x, y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        for g in opt.param_groups:
            g["lr"] = ds_warmup_cosine_lr(s, 1e-2, 3, 10, 0.1, 1e-4, "log")
        opt.step()
        opt.zero_grad()
    ours = {k: v.detach() for k, v in model.named_parameters()}
    assert rel_err(ours, {k: v.detach() for k, v in ref.named_parameters()}) < 1e-6
    engine.close()
