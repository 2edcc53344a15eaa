"""ZeRO-Infinity in training (zero/states/disk.py): parameter shards and optimizer states in
a host or NVMe tier give the very same training as without (bit-exact, CPU fp32), resume
from any tier into any tier, read ahead of the compute, and fail cleanly on a bad disk."""

from __future__ import annotations

import errno
import itertools
import os
import time

import pytest
import torch

from zerotrain.zero.tiers import io as tier_io
from zerotrain.zero.tiers.io import PREFIX, TierError

from multirank import run_ranks
from zero_harness import batches, local_batch, make_config, run_many

STAGE3 = {"zero": {"stage": 3}}


def tiers(param: str, opt: str, path: str) -> dict:
    nvme = {"nvme_path": path, "nvme_block_mb": 0.0625} if "nvme" in (param, opt) else {}
    return {"zero": {"stage": 3, "offload_param": param, "offload_optimizer": opt, **nvme}}


CASES = [("cpu", "none"), ("nvme", "none"), ("none", "nvme"), ("nvme", "nvme"),
         ("cpu", "cpu")]


def _equivalence(path: str, cases: list[tuple[str, str]]) -> list[dict]:
    accum = {"data": {"grad_accum_steps": 2}}
    runs = [{**STAGE3, **accum}] + [{**tiers(p, o, path), **accum} for p, o in cases]
    return run_many(runs, steps=3)


def _three_ranks(path: str, ckpt: str) -> tuple[list[dict], dict]:
    return _equivalence(path, CASES[1:4:2]), _saved_params(path, ckpt)


@pytest.mark.parametrize("world", [1, 3])
def test_tiers_train_exactly_like_no_offload(tmp_path, world):
    """Every tier combination on one rank (in this process), the two NVMe ones on three;
    a checkpoint the three ranks save with both tiers on NVMe loads into one rank with
    none, exactly (any tier, any world size)."""
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    if world == 1:
        res, cases = [_equivalence(str(swap), CASES)], CASES
    else:
        out = run_ranks(_three_ranks, world, str(swap), str(ckpt))
        res, cases = [r[0] for r in out], CASES[1:4:2]
        loaded = _load_at(str(ckpt))
        for k, v in out[0][1].items():
            assert torch.equal(loaded[k], v), k
    for rank_res in res:
        ref, *rest = rank_res
        for (p, o), r in zip(cases, rest, strict=True):
            assert r["losses"] == ref["losses"], (p, o)
            for k, v in ref["params"].items():
                assert torch.equal(r["params"][k], v), (p, o, k)
            mem = r["memory"]
            if p == "nvme":  # shards on disk: no parameter bytes held between uses
                assert mem["device"]["params"] == 0 < ref["memory"]["device"]["params"]
            if o == "nvme":  # gradient shards, masters and moments on disk
                for what in ("grads", "master", "optimizer"):
                    assert mem["device"][what] + mem["host"][what] == 0, what
    assert list(swap.iterdir()) == []  # every run's swap directory is gone


# ----------------------------------------------------------------------------- resume
def _engine(overrides: dict):
    from zerotrain.comm.dist import world
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT

    cfg = make_config(overrides, world()[1], 6)
    torch.manual_seed(0)
    return Engine(GPT(cfg.model), cfg, torch.device("cpu"))


def _train(eng, start: int, n: int) -> None:
    from zerotrain.comm.dist import world

    rank, w = world()
    b = eng.config.data.micro_batch_size
    for i, (X, Y) in enumerate(batches(start + n)):
        if i >= start:
            x, y = local_batch(X, Y, rank, w, b)
            eng.backward(eng(x, y))
            eng.step()


def _params(eng) -> dict[str, torch.Tensor]:
    with eng.full_parameters():
        return {k: p.detach().clone() for k, p in eng.module.named_parameters()}


def _resume(path: str, ckpt: str) -> dict:
    nvme = tiers("nvme", "nvme", path)
    straight = _engine(STAGE3)
    _train(straight, 0, 6)
    ref = _params(straight)
    straight.close()
    a = _engine(nvme)  # nvme → none → nvme, two steps each
    _train(a, 0, 2)
    a.save_checkpoint(f"{ckpt}/a")
    a.close()
    b = _engine(STAGE3)
    b.load_checkpoint(f"{ckpt}/a")
    _train(b, 2, 2)
    b.save_checkpoint(f"{ckpt}/b")
    b.close()
    c = _engine(nvme)
    c.load_checkpoint(f"{ckpt}/b")
    _train(c, 4, 2)
    out = {"ref": ref, "resumed": _params(c)}
    c.close()
    return out


def _load_at(ckpt: str) -> dict:
    """A checkpoint saved with NVMe tiers, loaded at another world size without tiers."""
    eng = _engine(STAGE3)
    eng.load_checkpoint(ckpt)
    out = _params(eng)
    eng.close()
    return out


def _saved_params(path: str, ckpt: str) -> dict:
    eng = _engine(tiers("nvme", "nvme", path))
    _train(eng, 0, 2)
    eng.save_checkpoint(ckpt)
    out = _params(eng)
    eng.close()
    return out


def test_resume_across_tiers(tmp_path):
    """nvme → none → nvme, two steps each, equals six steps without a tier."""
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    res = _resume(str(swap), str(ckpt))
    for k, v in res["ref"].items():
        assert torch.equal(res["resumed"][k], v), k
    assert not any(p.name.startswith(PREFIX) for p in swap.iterdir())


# ----------------------------------------------------------------------------- timeline
def test_fetch_of_next_unit_overlaps_compute(tmp_path, monkeypatch):
    """Each read is slowed to 50 ms; the read of unit k+1 starts before unit k's
    compute ends and is still running while unit k computes: the I/O is under the
    compute."""
    slow = os.preadv

    def preadv(fd, bufs, offset):
        time.sleep(0.05)
        return slow(fd, bufs, offset)

    monkeypatch.setattr(tier_io.os, "preadv", preadv)
    eng = _engine({**tiers("nvme", "none", str(tmp_path)), "model": {"n_layer": 4}})
    s = eng.strategy
    computed: dict[int, tuple[float, float]] = {}
    for u in s._blocks:
        u.module.register_forward_pre_hook(
            lambda m, a, i=u.index: computed.__setitem__(i, (time.perf_counter(), 0.0)))
        u.module.register_forward_hook(  # prepended: before ZeRO-3 reshards the unit
            lambda m, a, o, i=u.index: computed.__setitem__(i, (computed[i][0],
                                                                time.perf_counter())),
            prepend=True)
    X, Y = next(batches(1))
    eng(X[:4], Y[:4])
    loads = {i: h for i, h in s.store.tier.loads}
    blocks = [u.index for u in s._blocks]
    for k, nxt in itertools.pairwise(blocks):
        start, end = computed[k]
        assert loads[nxt].start < end, (k, loads[nxt].start, end)
        assert loads[nxt].end > start, k  # the read was in flight during unit k's compute
    eng.close()


# ----------------------------------------------------------------------------- faults
def test_unwritable_nvme_path_refused_before_start(tmp_path):
    target = tmp_path / "file"
    target.write_text("")
    bad = str(target / "swap")
    with pytest.raises(TierError, match=f"zero.nvme_path {bad}: cannot create"):
        _engine(tiers("nvme", "none", bad))


def test_full_disk_mid_run_one_error_and_checkpoint_intact(tmp_path, monkeypatch):
    swap = tmp_path / "swap"
    eng = _engine(tiers("nvme", "nvme", str(swap)))
    _train(eng, 0, 2)
    ckpt = eng.save_checkpoint(tmp_path / "ckpt")
    saved = _params(eng)
    files = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tier_io, "pwrite", full)
    with pytest.raises(TierError) as e:
        _train(eng, 2, 1)
    msg = str(e.value)
    assert msg.startswith(f"zero.nvme_path {swap}: writing unit")
    assert msg.count("No space left on device") == 1 and "bytes" in msg and "need" in msg
    monkeypatch.undo()
    eng.close()
    assert not any(swap.iterdir())  # the swap directory is removed after the error too
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == files
    back = _engine(STAGE3)
    back.load_checkpoint(tmp_path / "ckpt")
    for k, v in _params(back).items():
        assert torch.equal(v, saved[k]), k
    back.close()


def test_disk_bytes_per_step(tmp_path):
    """Per step and rank, with P the bytes of this rank's fp32 shards: each parameter
    shard is read for forward and for backward; it is its own master (fp32, one tier),
    read again for the update with Adam's two moments (from the second step: the first
    creates them) and written back once with them; each gradient shard is written in
    backward and read for the update. A separate master (offload_param none) is read and
    written itself, and the parameter shard is then not on disk."""
    eng = _engine(tiers("nvme", "nvme", str(tmp_path)))
    p = 4 * sum(u.padded_numel for u in eng.strategy.units)
    _train(eng, 0, 1)
    assert eng.last_tier_bytes == {"nvme": {"read": 2 * p + p + p, "written": p + 2 * p + p}}
    _train(eng, 1, 1)
    assert eng.last_tier_bytes == {"nvme": {"read": 2 * p + 3 * p + p,
                                            "written": p + 2 * p + p}}
    eng.close()
    eng = _engine(tiers("none", "nvme", str(tmp_path)))
    _train(eng, 0, 2)
    assert eng.last_tier_bytes == {"nvme": {"read": 3 * p + p, "written": 3 * p + p}}
    eng.close()


def test_prefetch_depth_changes_no_value(tmp_path):
    """Reads waited for one by one (0) or three units ahead: the same training."""
    out = []
    for depth in (0, 3):
        eng = _engine({**tiers("nvme", "nvme", str(tmp_path)),
                       "zero": {**tiers("nvme", "nvme", str(tmp_path))["zero"],
                                "offload_prefetch": depth}})
        _train(eng, 0, 2)
        out.append(_params(eng))
        eng.close()
    ref = _engine(STAGE3)
    _train(ref, 0, 2)
    for k, v in _params(ref).items():
        assert torch.equal(out[0][k], v) and torch.equal(out[1][k], v), k
    ref.close()


@pytest.mark.parametrize(("param", "opt"), [("nvme", "none"), ("none", "nvme"),
                                            ("nvme", "nvme")])
def test_disk_bytes_are_the_estimators(tmp_path, param, opt):
    """The engine's NVMe counters against `memory.tier_traffic` of the run's shape (the
    numbers `zerotrain estimate` shows), with two micro-steps. On a CPU the gradient
    shards of an optimizer on disk are on the disk too, and the estimator says so
    (written every micro-step, read back by each later micro-step to accumulate and by
    the update: A times each way)."""
    from zerotrain.memory import tier_traffic
    from zerotrain.zero import run_shape

    eng = _engine({**tiers(param, opt, str(tmp_path)), "data": {"grad_accum_steps": 2}})
    shape = run_shape(eng.strategy.kind, eng.config, eng.module, eng.plan, "cpu", 1)
    want = tier_traffic(shape).per_tier()["disk"]
    if opt == "nvme":  # the gradient term, by hand: A=2 micro-steps of the fp32 shard
        g = 4 * sum(u.padded_numel for u in eng.strategy.units)
        grads = sum(m.nbytes for m in tier_traffic(shape).moves if m.what.startswith("grads"))
        assert grads == 2 * 2 * g
    b = eng.config.data.micro_batch_size
    for i, (X, Y) in enumerate(batches(2)):  # the second step: the moments exist
        for m in range(2):
            x, y = local_batch(X, Y, 0, 1, b, m)
            eng.backward(eng(x, y))
            eng.step()
        if i == 1:
            assert eng.last_tier_bytes == {"nvme": want}
    eng.close()


def test_a_training_run_logs_its_disk_bytes_and_leaves_no_files(tmp_path):
    """`zerotrain train` with both tiers on NVMe: the same losses as without offload, each
    step's record carries the tier's bytes (= the estimator's, with the gradient term),
    and the run's swap folder is gone afterwards (checkpoints are separate)."""
    import json

    from zerotrain.memory import tier_traffic
    from zerotrain.run.loop import train
    from zerotrain.zero import run_shape

    from zero_harness import built_engine, run_config, train_losses

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    z = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
         "nvme_path": str(nvme)}
    plain = run_config(tmp_path, "plain", 3, zero={"stage": 3})
    disk = run_config(tmp_path, "disk", 3, zero=z)
    train(plain)
    train(disk)
    a, b = train_losses(tmp_path / "plain"), train_losses(tmp_path / "disk")
    assert sorted(a) == [1, 2, 3] and a == b
    recs = [json.loads(x) for x in (tmp_path / "disk" / "metrics.jsonl").read_text()
            .splitlines()]
    logged = [r["tier_bytes"]["nvme"] for r in recs if r["type"] == "train"]
    eng = built_engine(disk)
    shape = run_shape(eng.strategy.kind, eng.config, eng.module, eng.plan, "cpu", 1)
    eng.close()
    want = tier_traffic(shape).per_tier()["disk"]
    # steps 2 and 3 have moments: what the estimate says — the checkpoint saved after
    # step 2 read the states from the tier one at a time (its reads are the save's, not
    # a step's) and left them there, so step 3 writes nothing more
    assert logged[1] == want and logged[2] == want
    assert list(nvme.iterdir()) == []  # the swap folder was the run's own
    assert (tmp_path / "disk" / "checkpoints").is_dir()
