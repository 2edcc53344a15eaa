"""ZeRO++ on ZeRO-3: hpZ (secondary partition), qwZ (int8 parameter wire), qgZ
(hierarchical quantised gradient reduce-scatter), over 4 ranks cut into 2 emulated
nodes of 2 (`comm.node_size`)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from zerotrain.config import ConfigError, build_config
from zerotrain.config.nodes import node_problems
from zerotrain.deepspeed_config import from_deepspeed
from zerotrain.numerics.wire_quant import QMAX, decode, encode, encoded_bytes

from multirank import run_ranks
from zero_harness import batches, full_params, local_batch, make_config

NODES = {"comm": {"node_size": 2}, "zero": {"stage": 3}}


def _zero(**kw) -> dict:
    return {**NODES, "zero": {"stage": 3, **kw}}


# ------------------------------------------------------------------ the codes
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000])
def test_block_codes_bound_against_fp64_reference(bits, n):
    x = torch.randn(n, dtype=torch.float64) * 3
    z = min(7, n)
    x[:z] = 0  # zeros stay zeros
    buf = encode(x.float(), bits)
    assert buf.numel() == encoded_bytes(n, bits)
    y = decode(buf, n, bits, torch.float64)
    for a in range(0, n, 256):  # independent per-block reference in fp64
        blk = x[a : a + 256]
        scale = float(blk.abs().max()) / QMAX[bits]
        want = (blk / scale).round().clamp(-QMAX[bits], QMAX[bits]) * scale if scale else blk
        assert torch.allclose(y[a : a + 256], want, rtol=1e-6, atol=1e-7)
        assert float((y[a : a + 256] - blk).abs().max()) <= scale / 2 * (1 + 1e-6) + 1e-12
    assert torch.equal(y[:z], torch.zeros(z, dtype=torch.float64))


# ------------------------------------------------------------------ qgZ alone
def _qgz_worker(bits: int) -> dict:
    from zerotrain.comm.collectives import Comm
    from zerotrain.comm.dist import world
    from zerotrain.zero.states.grad_wire import QuantGradWire, reference_reduce

    rank, n = world()
    comm = Comm("native", node_size=2)
    wire = QuantGradWire(comm, bits)
    s = 300
    buckets = [torch.randn(n * s, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    out = torch.empty(s)
    comm.counter.reset()
    wire.reduce_scatter(comm, out, buckets[rank].clone()).wait()
    inter = comm.counter.inter()[0]
    ref = reference_reduce(buckets, 2, bits)[rank * s : (rank + 1) * s]
    plain = sum(buckets)[rank * s : (rank + 1) * s]
    comm.close()
    return {"out": out, "ref": ref, "plain": plain, "inter": inter}


@pytest.mark.parametrize("bits", [8, 4])
def test_qgz_equals_its_dequantise_then_sum_reference(bits):
    for res in run_ranks(_qgz_worker, 4, bits):
        assert torch.equal(res["out"], res["ref"])  # exact: same codes, same order
        # and within the stated bound of the plain sum (2 nodes, each node sum's block max)
        bound = 2 * res["plain"].abs().max() / (2 * QMAX[bits]) * 2
        assert float((res["out"] - res["plain"]).abs().max()) <= float(bound)
        # across nodes only this rank's 1 piece for the other node: codes + scales
        assert res["inter"] == encoded_bytes(300, bits)


# ------------------------------------------------------------------ in the engine
def _train(cases: list[tuple[dict, int]]) -> list[dict]:
    from zerotrain.comm.dist import world
    from zerotrain.engine import Engine
    from zerotrain.memory.traffic import node_traffic
    from zerotrain.models.gpt import GPT
    from zerotrain.zero import run_shape

    rank, n = world()
    out = []
    for over, steps in cases:
        cfg = make_config(over, n, steps)
        torch.manual_seed(0)
        eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
        b = cfg.data.micro_batch_size
        losses, inter, total = [], [], []
        for X, Y in batches(steps):
            x, y = local_batch(X, Y, rank, n, b)
            loss = eng(x, y)
            eng.backward(loss)
            eng.step()
            losses.append(float(eng.comm.all_reduce_scalars([loss.item()])[0]) / n)
            inter.append(eng.last_inter_bytes[0])
            total.append(eng.last_traffic_bytes[0])
        shape = run_shape(eng.strategy.kind, cfg, eng.module, eng.plan, "cpu", n)
        out.append(
            {
                "losses": losses,
                "inter": inter,
                "total": total,
                "params": full_params(eng),
                "predicted": node_traffic(shape, 2),
            }
        )
        eng.close()
    return out


def _bit_for_bit(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in b["params"])


def test_zeropp_options_in_the_engine():
    """33 steps (warmup 3): hpZ bit for bit ZeRO-3, alone and beside qwZ (its copies are
    the decoded values the forward saw); qwZ (33 steps), qgZ and all three (8 steps)
    within a small distance of ZeRO-3; all three cut the cross-node bytes to under a
    quarter."""
    qw = {"param_wire": "int8"}
    cases = [
        (NODES, 33),
        (_zero(secondary_partition=2), 33),
        (NODES, 8),
        (_zero(**qw), 33),
        (_zero(secondary_partition=2, **qw), 33),
        (_zero(grad_wire="int4"), 8),
        (_zero(secondary_partition=2, param_wire="int8", grad_wire="int4"), 8),
    ]
    base, hpz, base8, qwz, hpz_qwz, qgz, allz = run_ranks(_train, 4, cases)[0]
    _bit_for_bit(hpz, base)
    _bit_for_bit(hpz_qwz, qwz)
    assert hpz_qwz["losses"] != base["losses"]  # the int8 wire is on: not plain's numbers
    assert hpz["inter"][-1] < base["inter"][-1]
    assert hpz_qwz["inter"][-1] < qwz["inter"][-1]
    for res, ref in ((qwz, base), (qgz, base8), (allz, base8)):
        assert res["losses"][-1] < res["losses"][0] - 0.2  # it learns
        assert max(abs(a - b) for a, b in zip(res["losses"][:8], ref["losses"])) < 2e-2
    inter = base8["inter"][-1]
    assert base["inter"][-1] == inter  # the bytes per step do not depend on the run's length
    assert qwz["inter"][-1] < 0.7 * inter and qgz["inter"][-1] < 0.8 * inter
    assert allz["inter"][-1] <= 0.25 * inter
    # nothing stays inside a node in plain ZeRO-3 that hpZ does not keep there
    assert base["total"][-1] > base["inter"][-1] > 0
    # the estimator predicts both, per option (qwZ's scales: per 256 of a shard on the
    # wire, per 256 of the unit in the estimate, hence a tolerance)
    for res in (base, hpz, qwz, hpz_qwz, qgz, allz):
        want_total, want_inter = res["predicted"]
        assert res["total"][-1] == pytest.approx(want_total, rel=0.01)
        assert res["inter"][-1] == pytest.approx(want_inter, rel=0.01)


def test_deepspeed_zeropp_keys_map_to_the_three_options():
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "zero_hpz_partition_size": 2,
            "zero_quantized_weights": True,
            "zero_quantized_gradients": True,
        },
    }
    z = from_deepspeed(ds, world_size=4)["zero"]
    assert (z["secondary_partition"], z["param_wire"], z["grad_wire"]) == (2, "int8", "int4")
    ds["zero_optimization"]["stage"] = 2
    with pytest.raises(Exception, match=r"zero_hpz_partition_size.*ZeRO-3"):
        from_deepspeed(ds, world_size=4)


# ------------------------------------------------------------------ bad input
def test_zeropp_bad_input_names_the_field():
    with pytest.raises(Exception, match=r"zero\.secondary_partition"):
        build_config({"zero": {"stage": 2, "secondary_partition": 2}})
    with pytest.raises(Exception, match=r"zero\.grad_wire"):
        build_config({"zero": {"stage": 1, "grad_wire": "int8"}})
    with pytest.raises(Exception, match="param_wire fp8"):
        build_config({"zero": {"stage": 3, "param_wire": "fp8"}})
    cfg = build_config({"zero": {"stage": 3, "secondary_partition": 4}, "comm": {"node_size": 2}})
    assert any(
        "zero.secondary_partition (4) must divide comm.node_size (2)" in p
        for p in node_problems(cfg, 4)
    )
    cfg = build_config({"comm": {"node_size": 3}})
    assert any(
        "comm.node_size (3) must divide the world size (4)" in p for p in node_problems(cfg, 4)
    )
    assert node_problems(build_config(_zero(secondary_partition=2)), 4) == []
    assert issubclass(ConfigError, ValueError)


# ------------------------------------------------------------------ checkpoints
ALL3 = _zero(secondary_partition=2, param_wire="int8", grad_wire="int4")


def _save_with_all_three(path: str) -> dict:
    from zerotrain.comm.dist import world
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT

    rank, n = world()
    cfg = make_config(ALL3, n, 3)
    torch.manual_seed(0)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    for X, Y in batches(3):
        x, y = local_batch(X, Y, rank, n, cfg.data.micro_batch_size)
        eng.backward(eng(x, y))
        eng.step()
    eng.save_checkpoint(path)
    params = full_params(eng)
    eng.close()
    return params


def _load_elsewhere(path: str, stage: int) -> dict:
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT

    cfg = make_config({"zero": {"stage": stage}}, 2, 3)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    eng.load_checkpoint(path)
    params = full_params(eng)
    eng.close()
    return params


def test_a_zeropp_checkpoint_resumes_at_another_world_size_and_stage(tmp_path):
    """None of the three options changes a model state: what 4 ranks with all three
    saved loads into 2 ranks at stage 1 and 3, weights bit for bit."""
    saved = run_ranks(_save_with_all_three, 4, str(tmp_path / "ck"))[0]
    for stage in (1, 3):
        loaded = run_ranks(_load_elsewhere, 2, str(tmp_path / "ck"), stage)[0]
        assert all(torch.equal(loaded[k], saved[k]) for k in saved), stage


# ------------------------------------------------------------------ memory
def _hpz_copies(_: None) -> tuple[int, int, int]:
    """hpZ's copies at the end of a forward, as the store holds them and as the
    estimate counts them (its forward peak with K=2 minus without)."""
    from zerotrain.comm.dist import world
    from zerotrain.engine import Engine
    from zerotrain.memory.phases import phase_estimates
    from zerotrain.models.gpt import GPT
    from zerotrain.zero import run_shape

    rank, n = world()
    cfg = make_config(_zero(secondary_partition=2), n, 4)
    torch.manual_seed(0)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    X, Y = next(iter(batches(1)))
    x, y = local_batch(X, Y, rank, n, cfg.data.micro_batch_size)
    loss = eng(x, y)
    held = eng.strategy.store.hpz.resident_bytes()
    eng.backward(loss)
    after = eng.strategy.store.hpz.resident_bytes()
    eng.step()
    plain = make_config(NODES, n, 4)
    on, off = (
        phase_estimates(
            replace(  # the bare sum: no allocator allowance, no running max
                run_shape(eng.strategy.kind, c, eng.module, eng.plan, "cpu", n),
                retention=0.0,
                high_water=False,
            )
        )
        for c in (cfg, plain)
    )
    eng.close()
    return held, on["forward"] - off["forward"], after


def test_hpz_copies_are_what_the_estimate_counts():
    for held, estimated, after in run_ranks(_hpz_copies, 4, None):
        assert held == estimated > 0  # every unit's 1/K between forward and backward
        assert after == 0  # released as each unit's gradients are reduced
