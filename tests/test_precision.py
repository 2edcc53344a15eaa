"""Mixed precision and loss scaling, demonstrated on the real GPT."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from zerotrain.config import LossScaleConfig, ModelConfig
from zerotrain.data.corpus import load_tokens
from zerotrain.data.sampler import WindowSampler
from zerotrain.engine import Engine
from zerotrain.models.gpt import GPT
from zerotrain.numerics.precision import PrecisionPolicy
from zerotrain.numerics.scaler import LossScaleError, LossScaler

from multirank import run_ranks
from zero_harness import batches, local_batch, make_config


def _grads(model):
    return torch.cat([p.grad.float().flatten() for p in model.parameters()])


def test_fp16_gradients_flush_to_zero_without_scaling():
    """Late in training (or averaged over many micro-batches) gradients are tiny: here the
    loss is divided by 1024, as a 1024-way accumulation would. FP16 (min subnormal 2^-24)
    flushes a measured share of them to zero; a 2^16 loss scale keeps them."""
    torch.manual_seed(0)
    m = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=32))
    x, y = torch.randint(0, 256, (16, 32)), torch.randint(0, 256, (16, 32))
    (m(x, y) / 1024).backward()
    g32 = _grads(m)
    nonzero = g32 != 0

    def fp16_grads(scale: float) -> torch.Tensor:
        h = copy.deepcopy(m).half()
        h.zero_grad()
        (h(x, y) * (scale / 1024)).backward()
        return _grads(h) / scale

    lost_unscaled = ((fp16_grads(1.0) == 0) & nonzero).float().sum() / nonzero.sum()
    g_scaled = fp16_grads(2.0**16)
    lost_scaled = ((g_scaled == 0) & nonzero).float().sum() / nonzero.sum()
    assert lost_unscaled > 0.05  # measured ≈ 16%
    assert lost_scaled < 1e-3    # measured ≈ 0.004%
    assert float((g_scaled - g32).norm() / g32.norm()) < 0.01


def _tiny_engine(dtype: str, lr: float, **extra):
    cfg = make_config({"precision": {"dtype": dtype},
                       "optimizer": {"lr": lr, "weight_decay": 0.0, "grad_clip": None},
                       "schedule": {"warmup_steps": 0, "min_lr": lr}, **extra}, 1, 50)
    torch.manual_seed(0)
    return Engine(GPT(cfg.model), cfg, torch.device("cpu"))


def test_pure_bf16_stalls_while_fp32_master_learns():
    """Adam moves each weight by about lr = 1e-5 per step (|m̂/√v̂| stays near 1). A bf16
    weight of magnitude ≥ 2^-7 has half an ulp ≥ 2^-15 ≈ 3e-5, so the rounded update is
    exactly zero, step after step; the fp32 master accumulates the same updates and the
    bf16 copy follows it."""
    pure, mixed = _tiny_engine("bf16-pure", 1e-5), _tiny_engine("bf16", 1e-5)
    big = [(p.detach().clone(), p) for p in pure.module.parameters()]
    mixed_start = {n: p.detach().clone() for n, p in mixed.module.named_parameters()}
    master0 = [u.master.clone() for u in mixed.strategy.units]
    for X, Y in batches(20):
        for e in (pure, mixed):
            e.backward(e(X, Y))
            e.step()
    moved_pure = moved_mixed = total = 0
    for (before, p), (name, q) in zip(big, mixed.module.named_parameters()):
        mask = before.abs() >= 2**-7
        total += int(mask.sum())
        moved_pure += int((p.detach() != before)[mask].sum())
        moved_mixed += int((q.detach() != mixed_start[name])[mask].sum())
    assert total > 5_000
    assert moved_pure == 0
    assert moved_mixed / total > 0.25  # measured ≈ 39% after 20 steps, and growing
    moved_master = sum(int((u.master != m0).sum())
                       for u, m0 in zip(mixed.strategy.units, master0))
    assert moved_master / sum(m.numel() for m in master0) > 0.9


def _corpus_losses(dtype: str, steps: int = 40) -> list[float]:
    tokens = load_tokens(None)[: 2_000_000]
    sampler = WindowSampler(np.asarray(tokens), 64, seed=0)
    cfg = make_config({"model": {"block_size": 64, "n_embd": 64},
                       "precision": {"dtype": dtype},
                       "optimizer": {"lr": 3e-3},
                       "schedule": {"warmup_steps": 5, "min_lr": 3e-4}}, 1, steps)
    torch.manual_seed(0)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    out = []
    for step in range(steps):
        x, y = sampler.batch(step, 0, 0, 1, 16, 1)
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        out.append(loss.item())
    return out


def test_mixed_precision_tracks_fp32_loss_curve():
    """Tolerance: the mean |Δloss| over the last 10 of 40 steps stays below 0.05 nats
    while the loss itself falls by more than 1 nat."""
    ref = _corpus_losses("fp32")
    assert ref[0] - np.mean(ref[-10:]) > 1.0
    for dtype in ("bf16", "fp16"):
        cur = _corpus_losses(dtype)
        gap = float(np.mean(np.abs(np.array(cur[-10:]) - np.array(ref[-10:]))))
        assert gap < 0.05, f"{dtype}: mean |Δloss| {gap:.3f}"


def _inject_inf_run(stage: int, inf_rank: int) -> dict:
    from zerotrain.comm.dist import world

    rank, n = world()
    cfg = make_config({"precision": {"dtype": "fp16", "loss_scale": {"hysteresis": 2}},
                       "zero": {"stage": stage}}, n, 10)
    torch.manual_seed(0)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    b = cfg.data.micro_batch_size
    poison = {"on": False}
    w = eng.module.blocks[0].mlp.fc.weight
    w.register_hook(lambda g: g * float("inf") if poison["on"] and rank == inf_rank else g)
    scales, skipped = [], []
    snaps = []
    for i, (X, Y) in enumerate(batches(5)):
        poison["on"] = i in (2, 3)
        if i == 2:
            snaps.append((torch.cat([u.master.detach().clone() for u in eng.strategy.units]),
                          {k: {n_: t.clone() for n_, t in v.items()}
                           for k, v in eng.optimizer.state_dict()["state"].items()}))
        eng.backward(eng(*local_batch(X, Y, rank, 2, b)))
        info = eng.step()
        scales.append(info.loss_scale)
        skipped.append(info.skipped)
        if i == 3:
            snaps.append((torch.cat([u.master.detach().clone() for u in eng.strategy.units]),
                          {k: {n_: t.clone() for n_, t in v.items()}
                           for k, v in eng.optimizer.state_dict()["state"].items()}))
    return {"scales": scales, "skipped": skipped, "snaps": snaps,
            "skipped_total": eng.scaler.skipped, "final_scale": eng.scaler.scale}


def _check_inf(res: dict) -> None:
    assert res["skipped"] == [False, False, True, True, False]
    s0 = res["scales"][0]
    # scale used at each step: first overflow is absorbed by hysteresis, second halves
    assert res["scales"][:4] == [s0, s0, s0, s0] and res["final_scale"] == s0 / 2
    assert res["skipped_total"] == 2
    (m_before, st_before), (m_after, st_after) = res["snaps"]
    assert torch.equal(m_before, m_after)  # weights untouched by both skipped steps
    for k in st_before:
        for name, t in st_before[k].items():
            assert torch.equal(t, st_after[k][name]), f"optimizer state {k}.{name} changed"


def test_injected_inf_skips_and_backs_off_single_process():
    _check_inf(_inject_inf_run(0, 0))


def test_inf_on_one_rank_skips_everywhere():
    for res in run_ranks(_inject_inf_run, 2, 2, 1):  # ZeRO-2: only rank 1 sees the inf
        _check_inf(res)


@pytest.mark.parametrize("dtype,accum,per_param,label", [
    ("fp32", "fp32", 16, "params float32, master none"),
    ("bf16", "compute", 16, "grads accumulate in bfloat16"),
    ("bf16", "fp32", 18, "grads accumulate in float32"),
    ("fp16", "fp32", 18, "dynamic loss scaling"),
])
def test_model_state_bytes_per_parameter(dtype, accum, per_param, label):
    cfg = make_config({"precision": {"dtype": dtype, "grad_accum_dtype": accum},
                       "zero": {"bucket_mb": 100}}, 1, 10)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    X, Y = next(iter(batches(1)))
    eng.backward(eng(X, Y))
    eng.step()  # optimizer states exist after the first step
    rep = eng.memory_report()
    total = sum(rep["model_states"]["device"].values())
    psi = eng.module.num_params()
    padding = eng.strategy.units[0].padded_numel - psi
    assert total == per_param * psi + (per_param - 8) * padding
    assert label in rep["precision"]


def test_policy_table():
    from zerotrain.config import PrecisionConfig

    p = PrecisionPolicy.from_config(PrecisionConfig(dtype="bf16"))
    assert (p.param_dtype, p.master_dtype, p.grad_dtype, p.reduce_dtype) == (
        torch.bfloat16, torch.float32, torch.float32, torch.float32)
    pure = PrecisionPolicy.from_config(PrecisionConfig(dtype="bf16-pure"))
    assert pure.master_dtype is None and not pure.loss_scaling
    assert PrecisionPolicy.from_config(PrecisionConfig(dtype="fp16")).loss_scaling


# ----------------------------------------------------------------------------- scaler


def test_dynamic_scaler_grows_backs_off_with_hysteresis():
    s = LossScaler(LossScaleConfig(init_scale=1024, window=3, hysteresis=2), enabled=True)
    for _ in range(3):
        s.update(False)
    assert s.scale == 2048
    s.update(True)  # absorbed by hysteresis
    assert s.scale == 2048 and s.skipped == 1
    s.update(True)
    assert s.scale == 1024 and s.skipped == 2
    s.update(True)  # hysteresis re-armed after the back-off
    assert s.scale == 1024
    s2 = LossScaler(LossScaleConfig(), enabled=True)
    s2.load_state_dict(s.state_dict())
    assert s2.state_dict() == s.state_dict()


def test_scaler_min_scale_error_and_clamp():
    cfg = LossScaleConfig(init_scale=2, hysteresis=1, min_scale=1)
    s = LossScaler(cfg, enabled=True)
    s.update(True)
    assert s.scale == 1
    with pytest.raises(LossScaleError, match="min_scale"):
        s.update(True)
    c = LossScaler(cfg.model_copy(update={"on_min_scale": "clamp"}), enabled=True)
    for _ in range(3):
        c.update(True)
    assert c.scale == 1 and c.skipped == 3


def test_static_and_disabled_scalers_still_count_skips():
    st = LossScaler(LossScaleConfig(kind="static", init_scale=128), enabled=True)
    st.update(True)
    st.update(False)
    assert st.scale == 128 and st.skipped == 1
    off = LossScaler(LossScaleConfig(), enabled=False)
    off.update(True)
    assert off.scale == 1.0 and off.skipped == 1
