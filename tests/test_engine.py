"""The engine against a plain PyTorch loop, and its step/accumulation contract."""

from __future__ import annotations

import copy

import pytest
import torch

from zerotrain.engine import Engine
from zerotrain.models.gpt import GPT
from zerotrain.optim.schedule import lr_from_config

from multirank import run_ranks
from zero_harness import batches, make_config, rel_err, train_tiny


def test_engine_equals_plain_torch_loop():
    """Independent reference: torch.optim.AdamW + clip_grad_norm_ + the same lr schedule,
    with the same decay/no-decay split, on an untouched copy of the model."""
    cfg = make_config({"data": {"grad_accum_steps": 2}}, 1, 12)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    ref = copy.deepcopy(model)
    eng = Engine(model, cfg, torch.device("cpu"))
    decay = [p for p in ref.parameters() if p.ndim >= 2]
    other = [p for p in ref.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optimizer.weight_decay},
                             {"params": other, "weight_decay": 0.0}],
                            lr=cfg.optimizer.lr, betas=cfg.optimizer.betas,
                            eps=cfg.optimizer.eps, foreach=False)
    b = cfg.data.micro_batch_size
    for step, (X, Y) in enumerate(batches(12)):
        for m in range(2):
            x, y = X[m * b:(m + 1) * b], Y[m * b:(m + 1) * b]
            eng.backward(eng(x, y))
            info = eng.step()
            assert (info is None) == (m == 0)  # only the boundary micro-step steps
            (ref(x, y) / 2).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.optimizer.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_from_config(step, cfg.schedule, cfg.optimizer.lr, cfg.train.steps)
        opt.step()
        opt.zero_grad()
        assert info.grad_norm == pytest.approx(float(norm), rel=1e-5)
        assert info.lr == opt.param_groups[0]["lr"]
    # stage 0 with an elementwise rule: one flat run per (bucket, group), not per tensor
    runs = {(seg.unit, seg.group) for seg, _ in eng.strategy.opt_segments}
    n_opt = sum(len(g["params"]) for g in eng.optimizer.param_groups)
    assert n_opt == len(runs) < len(list(model.parameters()))
    assert all(p.ndim == 1 for g in eng.optimizer.param_groups for p in g["params"])
    ours = dict(eng.module.named_parameters())
    err = rel_err({k: v.detach() for k, v in ours.items()},
                  {k: v.detach() for k, v in ref.named_parameters()})
    assert err < 1e-6


def _muon(_=None):
    return train_tiny({"optimizer": {"name": "muon", "lr": 0.02}}, 10)


def test_muon_groups_and_ddp_equivalence():
    cfg = make_config({"optimizer": {"name": "muon"}}, 1, 10)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    groups = {g["group_id"]: g for g in eng.optimizer.param_groups}
    assert groups[2]["use_muon"] is False  # embeddings / tied head on the AdamW fallback
    assert all(p.ndim == 2 for p in groups[0]["params"])  # real matrix shapes at stage 0
    single = _muon()
    assert single["losses"][-1] < single["losses"][0] - 0.5
    dist = run_ranks(_muon, 2, None)[0]
    assert rel_err(dist["params"], single["params"]) < 1e-5
