"""Distributed Muon's momentum through checkpoints: exact resume, resharding to another
world size and stage, and no silent change of optimizer on resume.

The owner saves each matrix's momentum as one optimizer tensor covering the matrix's
whole flat range, so `SavedShards` reads it back for any cut: replicated stage 0 (one
tensor per parameter) or another set of owners.
"""

from __future__ import annotations

import functools

import pytest
import torch

from zerotrain.checkpoint import CheckpointError
from zerotrain.comm.dist import world
from zerotrain.config import deep_merge
from zerotrain.engine import Engine
from zerotrain.models.gpt import GPT

from multirank import run_ranks
from zero_harness import batches, full_params, local_batch, make_config, rel_err

MUON = {"optimizer": {"name": "muon", "lr": 0.02}, "zero": {"bucket_mb": 0.05}}
BEFORE, AFTER = 4, 3  # steps before the save, steps after it
TOL = 1e-5


def _engine(overrides: dict, seed: int) -> Engine:
    _, n = world()
    cfg = make_config(overrides, n, 10)
    torch.manual_seed(seed)
    return Engine(GPT(cfg.model), cfg, torch.device("cpu"))


def _train(eng: Engine, data: list) -> list[float]:
    rank, n = world()
    b = eng.config.data.micro_batch_size
    losses = []
    for X, Y in data:
        loss = eng(*local_batch(X, Y, rank, n, b))
        losses.append(float(eng.comm.all_reduce_scalars([loss.item()])[0]) / n)
        eng.backward(loss)
        eng.step()
    return losses


def _continued(eng: Engine, data: list) -> dict:
    losses = _train(eng, data)
    out = {"losses": losses, "params": full_params(eng),
           "state": len(eng.optimizer.state)}
    eng.close()
    return out


def _save_and_resume(path: str) -> dict:
    """ZeRO-2 Muon: train, save, continue (the uninterrupted run); a fresh engine loads
    and continues; another loads with the optimizer state reset."""
    data = list(batches(BEFORE + AFTER))
    ref = _engine(deep_merge(MUON, {"zero": {"stage": 2}}), 0)
    _train(ref, data[:BEFORE])
    ref.save_checkpoint(path)
    out = {"uninterrupted": _continued(ref, data[BEFORE:])}
    eng = _engine(deep_merge(MUON, {"zero": {"stage": 2}}), 99)
    eng.load_checkpoint(path)
    out["resumed"] = _continued(eng, data[BEFORE:])
    eng = _engine(deep_merge(MUON, {"zero": {"stage": 2}}), 99)
    eng.load_checkpoint(path, reset_optimizer=True)
    out["reset"] = _continued(eng, data[BEFORE:])
    return out


@functools.cache
def saved(root: str) -> list[dict]:
    return run_ranks(_save_and_resume, 2, root + "/muon2")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("muon_ckpt"))


def test_muon_resumes_exactly(root):
    runs = saved(root)
    for r in runs:
        a, b = r["uninterrupted"], r["resumed"]
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    # the momentum matters: dropping it changes the continuation far beyond TOL
    a, c = runs[0]["uninterrupted"], runs[0]["reset"]
    assert rel_err(c["params"], a["params"]) > 100 * TOL


@pytest.mark.parametrize("stage", [0, 3])
def test_muon_reshards_to_one_rank(root, stage):
    """Saved by 2 owners at ZeRO-2; resumed by one process as replicated stage 0 (per-
    parameter momentum) or ZeRO-3 (every matrix owned by rank 0)."""
    want = saved(root)[0]["uninterrupted"]
    eng = _engine(deep_merge(MUON, {"zero": {"stage": stage}}), 99)
    eng.load_checkpoint(root + "/muon2")
    assert eng.last_load.resharded
    got = _continued(eng, list(batches(BEFORE + AFTER))[BEFORE:])
    err = rel_err(got["params"], want["params"])
    gap = max(abs(x - y) / abs(y) for x, y in zip(got["losses"], want["losses"]))
    assert err < TOL and gap < TOL, f"stage {stage}: weights {err:.2e}, losses {gap:.2e}"


def test_changing_optimizer_on_resume_is_refused_both_ways(root, tmp_path):
    """Adam state never flows into Muon nor Muon's into Adam: refused unless the
    optimizer state is reset, and then it starts empty."""
    adam = _engine({"zero": {"stage": 2}}, 0)
    _train(adam, list(batches(BEFORE)))
    adam.save_checkpoint(tmp_path / "adam")
    muon_ckpt = root + "/muon2"
    saved(root)  # the Muon checkpoint exists
    for src, overrides in ((tmp_path / "adam", deep_merge(MUON, {"zero": {"stage": 2}})),
                           (muon_ckpt, {"zero": {"stage": 2}})):
        eng = _engine(overrides, 99)
        with pytest.raises(CheckpointError, match="reset the optimizer"):
            eng.load_checkpoint(src)
        eng.load_checkpoint(src, reset_optimizer=True)
        assert eng.last_load.optimizer_reset and not eng.optimizer.state
        got = _continued(eng, list(batches(BEFORE + 1))[BEFORE:])
        assert got["state"] > 0 and all(torch.isfinite(v).all() for v in got["params"].values())
