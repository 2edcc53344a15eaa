"""Shared harness for the distributed tests: train a tiny GPT the same way on 1 or N ranks.

`train_tiny(overrides, steps)` runs on whatever process group is open (none = one
process) and feeds every rank its slice of the same global batch, so any stage at any
world size can be compared with a single process on the full batch.
"""

from __future__ import annotations

import contextlib

import torch

from zerotrain.config import build_config, deep_merge
from zerotrain.data.sampler import local_rows
from zerotrain.models.gpt import GPT

GLOBAL_BATCH = 24  # divisible by 1, 2, 3 and 4 ranks, times 2 micro-steps
SEQ = 16

# No biases: the key projection's bias gets an exactly-zero true gradient (softmax is
# shift-invariant), so Adam would turn reduction-order rounding noise into full ±lr
# steps and no two summation orders could ever agree.
BASE = {
    "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": SEQ, "bias": False},
    "optimizer": {"lr": 1e-2, "grad_clip": 0.3},
    "schedule": {"warmup_steps": 3, "min_lr": 1e-3},
    "zero": {"bucket_mb": 0.02},
    "comm": {"algorithm": "native", "check_lockstep": True},  # a mismatch: an error, not a hang
    "train": {"steps": 20, "device": "cpu"},
}


def make_config(overrides: dict, world: int, steps: int):
    accum = overrides.get("data", {}).get("grad_accum_steps", 1)
    data = {"micro_batch_size": GLOBAL_BATCH // world // accum}
    cfg = deep_merge(BASE, {"data": data, "train": {"steps": steps}})
    return build_config(deep_merge(cfg, overrides))


def batches(steps: int):
    """Global batches cycling over a small fixed pool, so a few steps visibly learn it."""
    g = torch.Generator().manual_seed(1234)
    pool = [(torch.randint(0, 256, (GLOBAL_BATCH, SEQ), generator=g),
             torch.randint(0, 256, (GLOBAL_BATCH, SEQ), generator=g)) for _ in range(3)]
    for i in range(steps):
        yield pool[i % len(pool)]


def local_batch(X, Y, rank: int, world: int, b: int, micro: int = 0):
    """This rank's rows of a global batch (zerotrain.data.sampler.local_rows)."""
    rows = local_rows(micro, rank, world, b)
    return X[rows], Y[rows]


def full_params(engine) -> dict[str, torch.Tensor]:
    """Every parameter in full (gathered under ZeRO-3), as fp32."""
    with engine.full_parameters():
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def train_tiny(overrides: dict, steps: int = 20, seed: int = 0, model_fn=None,
               probe=None) -> dict:
    """`probe(engine)`, if given, is called before training; what it returns (it may keep
    filling it during training) comes back as res["probe"]."""
    from zerotrain.comm.dist import world
    from zerotrain.engine import Engine

    rank, n = world()
    overrides = dict(overrides)
    meta = overrides.pop("meta", False)  # build on the meta device: the engine initialises
    cfg = make_config(overrides, n, steps)
    torch.manual_seed(seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = model_fn() if model_fn else GPT(cfg.model)
    eng = Engine(model, cfg, torch.device("cpu"))
    probed = probe(eng) if probe is not None else None
    accum = cfg.data.grad_accum_steps
    b = cfg.data.micro_batch_size
    losses, norms, traffic = [], [], []
    for X, Y in batches(steps):
        total = 0.0
        for m in range(accum):
            x, y = local_batch(X, Y, rank, n, b, m)
            loss = eng(x, y) if model_fn is None else eng(input_ids=x, labels=y).loss
            eng.backward(loss)
            info = eng.step()
            total += loss.item()
        # the global batch's mean loss (a control reduction, not counted as traffic)
        losses.append(float(eng.comm.all_reduce_scalars([total / accum])[0]) / n)
        norms.append(info.grad_norm)
        traffic.append(eng.last_traffic_bytes[0])
    mem = eng.strategy.memory_breakdown(eng.optimizer.state.values())
    res = {"params": full_params(eng), "losses": losses, "norms": norms, "traffic": traffic,
           "memory": mem, "buffer_numels": eng.strategy.buffer_numels(),
           "numel": sum(p.numel() for p in eng.module.parameters()),
           "skipped": eng.scaler.skipped, "probe": probed,
           "muon": eng.strategy.updater.summary()}
    eng.close()
    return res


def run_many(cases: list[dict], steps: int = 20, probe=None) -> list[dict]:
    """Several configurations in one set of spawned ranks (spawning is the slow part)."""
    return [train_tiny(c, steps, probe=probe) for c in cases]


def rel_err(a: dict, b: dict) -> float:
    """Worst per-tensor ‖a−b‖ / ‖b‖."""
    return max(float((a[k] - b[k]).norm() / (b[k].norm() + 1e-30)) for k in b)


# ----------------------------------------------------------------------------- CLI runs


def corpus(tmp_path, copies: int = 3) -> str:
    """A small text corpus (this repo's engine source). Ranks of one test share tmp_path
    and call this concurrently: a private file renamed into place, so no rank ever reads
    a half-written (or truncated) corpus."""
    import os
    from pathlib import Path

    import zerotrain.engine as eng_mod

    p = tmp_path / "corpus.txt"
    tmp = tmp_path / f".corpus.{os.getpid()}.tmp"
    tmp.write_text(Path(eng_mod.__file__).read_text() * copies)
    os.replace(tmp, p)
    return str(p)


def run_config(tmp_path, run: str, steps: int, *, layers: int = 2, warmup: int = 0,
               every: int = 2, keep: int = 2, **extra):
    """A tiny `train()` config in tmp_path/run: sections of `extra` override the base."""
    d = {
        "model": {"n_layer": layers, "n_head": 2, "n_embd": 32, "block_size": 32},
        "data": {"path": corpus(tmp_path), "micro_batch_size": 4},
        "schedule": {"warmup_steps": warmup},
        "checkpoint": {"every": every, "keep": keep},
        "logging": {"run_dir": str(tmp_path / run), "log_every": 1, "eval_every": 0,
                    "sample_tokens": 0, "progress": False, "plot": False},
        "train": {"steps": steps, "threads": 1},
    }
    for k, v in extra.items():
        d.setdefault(k, {}).update(v)
    return build_config(d)


def train_losses(run_dir) -> dict[int, float]:
    """step -> logged training loss, from a run folder's metrics.jsonl."""
    import json
    from pathlib import Path

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    return {r["step"]: r["loss"] for r in recs if r["type"] == "train"}


def built_engine(cfg):
    """The config's model (its pretrained weights loaded, if it names any) in an Engine on
    the CPU — the setup the families' and sequence-parallel tests compare against."""
    from zerotrain.engine import Engine
    from zerotrain.models import build_model, pretrained_weights

    torch.manual_seed(0)
    model = build_model(cfg.model)
    weights = pretrained_weights(cfg.model, model)
    if weights is not None:
        weights.load_into(model)
    return Engine(model, cfg, torch.device("cpu"))
