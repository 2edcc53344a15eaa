"""Sharded initialisation and loading, held to their bytes (issue 13): a rank reads only
the slices of a pretrained file it keeps, and ZeRO-3's init peak stays within one unit of
the rank's final shard. (Meta init equal to eager init: test_zero.py.)"""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from zerotrain.config import build_config
from zerotrain.models import build_model, pretrained_weights
from zerotrain.models.gpt import GPT

from multirank import run_ranks
from zero_harness import full_params

SMALL = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32}


def _load(path: str, stages: list[int]) -> list[dict]:
    """This rank, at each stage: the meta model, filled from `path` through
    Engine(weights=...)."""
    from zerotrain.engine import Engine

    return [_load_one(Engine, path, s) for s in stages]


def _load_one(Engine: type, path: str, stage: int) -> dict:
    cfg = build_config({"model": {**SMALL, "init_from": path}, "zero": {"stage": stage},
                        "train": {"device": "cpu"}})
    model = build_model(cfg.model, device="meta")
    w = pretrained_weights(cfg.model, model)
    eng = Engine(model, cfg, torch.device("cpu"), weights=w.read_slice)
    read = w.bytes_read
    w.close()
    widest = max(p.numel() // p.shape[0] for p in model.parameters())
    out = {"read": read, "params": full_params(eng), "units": len(eng.strategy.units),
           "row_bytes": 4 * widest}
    eng.close()
    return out


def test_each_rank_reads_only_the_slices_it_keeps(tmp_path):
    torch.manual_seed(3)
    ref = GPT(build_config({"model": SMALL}).model)
    with torch.no_grad():  # values no initialiser would give: the file is what loads
        for p in ref.parameters():
            p.add_(torch.randn_like(p))
    path = tmp_path / "pretrained.safetensors"
    save_file({k: v.clone() for k, v in ref.state_dict().items()}, str(path))  # tied too
    total = 4 * sum(p.numel() for p in ref.parameters())  # the tied head is read once
    want = {n: p.detach() for n, p in ref.named_parameters()}
    stages = [0, 1, 2, 3]
    per_rank = run_ranks(_load, 2, str(path), stages)
    for stage, ranks in zip(stages, zip(*per_rank)):
        for r in ranks:
            assert r["params"].keys() == want.keys()
            assert all(torch.equal(r["params"][n], want[n]) for n in want), stage
        reads = [r["read"] for r in ranks]
        if stage == 0:  # DDP keeps every parameter, so it reads every parameter
            assert reads == [total, total]
            continue
        # ZeRO-1/2/3 keep 1/N of the master weights: a rank reads its half of each unit's
        # flat range, plus at most one partial row at each end of each unit's range.
        slack = 2 * ranks[0]["units"] * ranks[0]["row_bytes"]
        assert all(abs(r - total / 2) <= slack for r in reads), (stage, reads, total)
        assert total <= sum(reads) <= total + slack


#: ~50M parameters: 4 blocks of 12.6M (50 MB units, 16 MB largest parameter), so one
#: parameter is visible next to the shard (100 MB of parameters per rank).
BIG = {"n_layer": 4, "n_head": 8, "n_embd": 1024, "block_size": 64}
#: The init bound's fixed overhead: what init allocates besides the shards and the one
#: parameter being drawn — Python objects, parameter views, allocator rounding. Measured:
#: ~1 MiB (initial values are drawn in place, models/init.py); 16 MiB of room. The
#: optimizer here resolves to compiled (`auto`, 25M parameters per rank): its compile
#: check waits for the first step, so init does not load torch's compiler (~50 MiB).
OVERHEAD = 16 * 2**20


def _init_peak() -> dict:
    from zerotrain.engine import Engine

    cfg = build_config({"model": BIG, "zero": {"stage": 3}, "train": {"device": "cpu"}})
    torch.manual_seed(0)
    eng = Engine(build_model(cfg.model, device="meta"), cfg, torch.device("cpu"))
    # fp32: the master is the parameter shard; the gradient shard is never zeroed, so its
    # pages become resident at the first backward (zero/states/grads.py), not at init
    shard = eng.strategy.memory_breakdown()["device"]["params"]
    largest = max(s.numel for u in eng.strategy.units for s in u.slots) * 4
    out = {"init": eng.memory_phases()["measured"]["init"], "shard": shard,
           "largest": largest, "unit": max(u.padded_numel for u in eng.strategy.units) * 4,
           "params": sum(u.numel for u in eng.strategy.units)}
    eng.close()
    return out


def test_zero3_init_peak_is_the_shard_plus_one_parameter(monkeypatch):
    """Per rank, peak RSS during Engine(...) above the process before it ≤ the final
    shard + the largest parameter + OVERHEAD: ZeRO-3 draws each parameter whole and keeps
    its slice, so neither the model nor a whole unit ever exists on a rank. (glibc's mmap
    threshold fixed, as in test_memory_phases: no heap retention noise in the ranks.)"""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    for r in run_ranks(_init_peak, 2, fresh=True):
        assert r["params"] > 45e6 and r["largest"] + OVERHEAD < r["unit"]  # a real test
        assert r["init"] <= r["shard"] + r["largest"] + OVERHEAD, \
            (r["init"] / 2**20, r["shard"] / 2**20, r["largest"] / 2**20)
        assert r["init"] >= r["shard"]  # the measurement sees the shard itself
