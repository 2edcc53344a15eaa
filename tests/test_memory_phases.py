"""Peak memory per phase (`memory.phase_estimates`): hand-computed cases, the bucket-pool
replay against the real `ShardedGrads` pool, the estimate CLI's buffers against the
engine's, and one real run whose measured phases match the prediction."""

from __future__ import annotations

import json

import pytest
import torch

from zerotrain.cli.estimate import main_estimate, predict_peaks
from zerotrain.config import build_config
from zerotrain.memory import (
    CPU_BASELINE_BYTES,
    BytesPerParam,
    RunShape,
    bucket_pool_numel,
    phase_estimates,
    steady_peak,
)
from zerotrain.zero.partition import Partition
from zerotrain.zero.states.grads import ShardedGrads
from zerotrain.zero.unit import Unit

from multirank import run_ranks

FP32_ADAMW = BytesPerParam(params=4, grads=4, master=0, optimizer=8)
MIXED_ADAMW = BytesPerParam(params=2, grads=2, master=4, optimizer=8)


def phases_of(numels, world, stage, bpp, *, activations=0, offload=False, largest_param=0,
              **fields):
    """`phase_estimates` of a shape by stage number (the hand cases below)."""
    return phase_estimates(RunShape.for_stage(numels, world, stage, bpp, offload=offload,
                                              widest_param=largest_param, **fields),
                           activations)


# ----------------------------------------------------------------------------- by hand


def test_stage0_by_hand():
    # buffers of 10 and 6 elements, fp32 AdamW, N = 2: nothing sharded.
    # states: params 4·16 + grads 4·16 + Adam 8·16 = 256; save adds this rank's shard
    # (5 + 3 elements) of Adam 8·8 and params 4·8.
    got = phases_of([10, 6], 2, 0, FP32_ADAMW, activations=7, largest_param=3)
    assert got == {"init": 128,                # no Adam states before the first step
                   "forward": 256 + 7,
                   "backward": 256 + 7 + 3 * 4,  # + autograd's fresh gradient of 3 elements
                   "step": 256, "save": 256 + 64 + 32}


def test_stage2_by_hand_with_pool_runtime_and_retention():
    # N = 2: params full 4·16 = 64; grads 4·8 = 32, Adam 8·8 = 64 → states 160.
    # pool: buckets of 10 and 6 (fp32) both alive in one backward → 16·4 = 64.
    got = phases_of([10, 6], 2, 2, FP32_ADAMW, runtime=20, retention=0.5)
    assert got == {"init": 96, "forward": int(1.5 * (160 + 64 + 20)),
                   "backward": int(1.5 * (160 + 64 + 20)), "step": int(1.5 * (160 + 64 + 20)),
                   "save": int(1.5 * (160 + 64 + 20 + 64 + 32))}  # Adam + owned params


def test_stage3_by_hand():
    # mixed precision, N = 2, units of 10 and 6 (shards 5 and 3 = 8 elements):
    # params 2·8, grads 2·8, master 4·8, Adam 8·8 → 128; unit 10 in bf16 = 20 bytes,
    # gathered with prefetch 40; pool: buckets of 10 and 6 in fp32 reduce → 64.
    got = phases_of([10, 6], 2, 3, MIXED_ADAMW, largest_unit=10, activations=5)
    assert got["init"] == 128 - 64 + 20
    assert got["forward"] == 128 + 64 + 40 + 5
    assert got["step"] == 128 + 64
    assert got["save"] == 128 + 64 + 4 * 8 + 8 * 8  # master and Adam serialised
    no_prefetch = phases_of([10, 6], 2, 3, MIXED_ADAMW, largest_unit=10, prefetch=False)
    assert no_prefetch["forward"] == 128 + 64 + 20
    # on a CPU the never-zeroed gradient shard (2·8 bytes) is not resident at init
    lazy = phases_of([10, 6], 2, 3, MIXED_ADAMW, largest_unit=10, lazy_grads=True)
    assert lazy["init"] == 128 - 64 - 16 + 20 and lazy["step"] == got["step"]


def test_offload_fp32_keeps_a_separate_master_and_high_water_is_monotone():
    live = phases_of([10, 6], 2, 3, FP32_ADAMW, offload=True, largest_unit=10)
    # params 32, grads 32, a host master 32 (fp32 has none on the device), Adam 64
    assert live["step"] == 160 + 64 and live["init"] == 96 + 40
    hw = phases_of([10, 6], 2, 3, FP32_ADAMW, offload=True, largest_unit=10,
                         activations=10_000, high_water=True)
    values = list(hw.values())
    assert values == sorted(values) and hw["save"] == hw["forward"]
    assert steady_peak(hw) == hw["forward"]


# ----------------------------------------------------------------------------- pool


@pytest.mark.parametrize("in_flight", [0, 1, 2])
@pytest.mark.parametrize("sizes", [[8] * 6, [10, 6, 10, 6, 10, 6], [3, 5, 5, 5, 5, 3, 9],
                                   [7]])
def test_bucket_pool_replay_matches_the_real_pool(sizes, in_flight):
    """Drive `ShardedGrads` through one backward exactly as the strategy does (take a
    bucket, enqueue, retire the oldest past `in_flight`) and count what it allocated."""
    world = 2
    grads = ShardedGrads(torch.float32, torch.device("cpu"), pool_size=in_flight)
    made: set[int] = set()
    pending: list[Unit] = []
    for i, n in enumerate(sizes):
        u = Unit.build(i, f"u{i}", [(f"p{i}", torch.nn.Parameter(torch.zeros(n)), 0)],
                       Partition(world, 0))
        u.params = torch.zeros(u.padded_numel)
        made.add(grads.target(u).data_ptr())
        pending.append(u)
        if len(pending) > in_flight:
            grads.release(pending.pop(0))
    for u in pending:
        grads.release(u)
    pooled = sum(b.numel() for free in grads.pool.values() for b in free)
    assert len(made) == sum(len(f) for f in grads.pool.values())  # nothing dropped
    assert bucket_pool_numel(sizes, world, in_flight) == pooled


def _train_stage3(in_flight: int) -> tuple[dict, int]:
    from zerotrain.engine import Engine
    from zerotrain.models import build_model

    cfg = build_config({"model": {"n_layer": 4, "n_head": 2, "n_embd": 32, "block_size": 16},
                        "zero": {"stage": 3, "reductions_in_flight": in_flight},
                        "train": {"device": "cpu"}})
    torch.manual_seed(0)
    eng = Engine(build_model(cfg.model, device="meta"), cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 256, (2, 17), generator=g)
        eng.backward(eng(x[:, :-1], x[:, 1:]))
        eng.step()
    with eng.full_parameters():
        params = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    pooled = sum(len(f) for f in eng.strategy.grads.pool.values())
    eng.close()
    return params, pooled


def test_fewer_reductions_in_flight_pool_fewer_buckets_and_train_the_same():
    """`zero.reductions_in_flight` trades overlap for memory: each one fewer keeps one
    bucket fewer (4 blocks + the root: 5 buckets a backward), and the result is the same
    bit for bit (the reductions are the same, only waited for sooner)."""
    runs = {k: _train_stage3(k) for k in (0, 1, 2)}
    assert [runs[k][1] for k in (0, 1, 2)] == [1 + 1, 2 + 1, 3 + 1]  # + the root's size
    for k in (0, 1):
        assert all(torch.equal(runs[k][0][n], runs[2][0][n]) for n in runs[2][0])


def test_reductions_in_flight_auto_depends_on_the_device_and_refuses_nonsense():
    z = build_config({}).zero
    assert z.reductions_in_flight == "auto"
    assert (z.in_flight("cuda"), z.in_flight("cpu")) == (2, 0)
    assert build_config({"zero": {"reductions_in_flight": "3"}}).zero.in_flight("cuda") == 3
    for bad in (True, -1, 9, "lots", 1.5):
        with pytest.raises(ValueError, match="reductions_in_flight"):
            build_config({"zero": {"reductions_in_flight": bad}})


# ----------------------------------------------------------------------------- CLI


def test_estimate_uses_the_engines_buffers_and_prints_peaks(tmp_path, capsys):
    from zerotrain.engine import Engine
    from zerotrain.models import build_model

    model = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32}
    for stage in (0, 2, 3):
        cfg = build_config({"model": model, "zero": {"stage": stage, "bucket_mb": 0.05},
                            "train": {"device": "cpu"}})
        eng = Engine(build_model(cfg.model, device="meta"), cfg, torch.device("cpu"))
        got = predict_peaks(cfg, 1, stage, device="cpu")
        assert got["buffer_numels"] == eng.strategy.buffer_numels()
        assert got["steady"] == CPU_BASELINE_BYTES + steady_peak(got["phases"])
        eng.close()
    path = tmp_path / "m.yaml"
    path.write_text(json.dumps({"model": model, "precision": {"dtype": "fp32"}}))
    assert main_estimate(["--model", str(path), "--gpus", "2", "--device", "cuda",
                          "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert all(r["peaks"]["baseline"] == 0 and r["peaks"]["init"] > 0 for r in rows)
    assert main_estimate(["--model", str(path), "--gpus", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "predicted peak per rank (resident memory of a CPU rank" in out
    peaks = out[out.index("predicted peak per rank"):].split("\n\n")[0].splitlines()
    assert peaks[-1].startswith("ZeRO-3+offload |")  # the peak table's last row


# ----------------------------------------------------------------------------- real run

#: 9.5M parameters (3 blocks × 512): model states 150 MB at stage 0, big enough to see.
REAL = {"n_layer": 3, "n_head": 4, "n_embd": 512, "block_size": 64}
#: How far a small run's measured phases (above the engine's baseline) may be from the
#: prediction: 10 %, the estimator's target at scale, plus 32 MiB fixed — glibc's largest
#: mmap threshold: blocks under it (every activation, per-parameter gradient and init draw
#: of this model) are served from heaps that keep freed memory, in amounts no formula
#: tracks, and the first forward/backward loads kernels and code (oneDNN, SDPA). The test
#: fixes the threshold (see it); measured then: within 1 MiB at init, -36..+22 MiB after
#: (the step phase's own peak sits below the high-water prediction). It still fails a
#: prediction that forgets a term: the Adam states here are 76 MB, a gathered unit 13 MB
#: and the activations ~50 MB.
def tolerance(predicted: int) -> float:
    return 0.10 * predicted + 32 * 2**20


def _measure(stage: int) -> dict:
    from zerotrain.engine import Engine
    from zerotrain.memory import activation_bytes
    from zerotrain.models import build_model

    cfg = build_config({"model": REAL, "data": {"micro_batch_size": 2},
                        "zero": {"stage": stage}, "precision": {"dtype": "fp32"},
                        "train": {"device": "cpu"}})
    torch.manual_seed(0)
    eng = Engine(build_model(cfg.model, device="meta"), cfg, torch.device("cpu"))
    x = torch.randint(0, 256, (2, 64))
    for _ in range(3):
        eng.backward(eng(x, x))
        eng.step()
    act = activation_bytes(cfg.model, 2, 64, act_bytes=4)
    got = eng.memory_phases(activations=act)
    pred = predict_peaks(cfg, 1, stage, micro_batch=2, device="cpu")["phases"]
    eng.close()
    return {"measured": got["measured"], "predicted": pred}


@pytest.mark.parametrize("stage", [0, 3])
def test_measured_phases_match_the_prediction(stage, monkeypatch):
    """A fresh process (run_ranks, 1 rank), meta-built GPT, 3 steps: each phase's
    measured peak above the engine's baseline is the prediction within `tolerance`.

    The rank runs with glibc's mmap threshold fixed at 128 KiB, so every large block goes
    back to the OS when freed: with the default (dynamic) threshold, freed sub-32 MiB
    blocks stay in heaps in amounts that vary from run to run (measured at ZeRO-3's
    backward: +18..+55 MiB over three runs), which is allocator noise, not the model's
    terms; fixed, three runs agree within 1 MiB."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # the spawned rank's
    (res,) = run_ranks(_measure, 1, stage, fresh=True)
    m, p = res["measured"], res["predicted"]
    for phase in ("init", "forward", "backward", "step"):
        assert abs(m[phase] - p[phase]) <= tolerance(p[phase]), \
            (phase, m[phase] / 2**20, p[phase] / 2**20)
