"""The memory/traffic formulas of SPEC §6 against hand arithmetic, the ZeRO paper, and a
measurement of saved activations (the `zerotrain estimate` CLI: test_cli_estimate.py)."""

from __future__ import annotations

import pytest
import torch

from zerotrain.config import ModelConfig
from zerotrain.memory import (
    activation_bytes,
    activation_parts,
    block_activation_bytes,
    bytes_per_param,
    collective_cost,
    estimate,
    head_activation_bytes,
    model_state_bytes,
    model_state_bytes_from_buffers,
    precision_bytes,
    shard_numel,
    traffic_per_step,
)
from zerotrain.models import count_params
from zerotrain.models.gpt import GPT
from zerotrain.zero.cut import model_size, unit_numels

MIXED = dict(param_bytes=2, grad_bytes=2, master_bytes=4, optim_bytes=8)  # bf16 + AdamW

# ----------------------------------------------------------------------------- bytes/param


def test_bytes_per_param_by_precision():
    assert precision_bytes("fp32") == (4, 4, 0)  # fp32 params are the master
    assert precision_bytes("bf16") == (2, 2, 4)
    assert precision_bytes("fp16", "fp32") == (2, 4, 4)
    assert precision_bytes("bf16-pure") == (2, 2, 0)
    b = bytes_per_param("bf16", 8)
    assert (b.params, b.grads, b.master, b.optimizer) == (2, 2, 4, 8)
    assert b.master + b.optimizer == 12  # SPEC's K for mixed Adam
    with pytest.raises(ValueError):
        precision_bytes("fp8")


# ----------------------------------------------------------------------------- model states


def test_every_stage_by_hand():
    # Ψ = 1000, N = 4 → shard 250. bf16 params 2, grads 2, fp32 master 4, Adam m+v 8.
    kw = dict(MIXED, largest_unit=100)
    ddp = model_state_bytes(1000, 4, 0, **kw)
    assert ddp.device == {"params": 2000, "grads": 2000, "master": 4000, "optimizer": 8000}
    assert ddp.device_total == 16_000 and ddp.gathered == 0 and ddp.host_total == 0
    z1 = model_state_bytes(1000, 4, 1, **kw)  # master 4·250, optimizer 8·250
    assert z1.device == {"params": 2000, "grads": 2000, "master": 1000, "optimizer": 2000}
    z2 = model_state_bytes(1000, 4, 2, **kw)  # + grads 2·250
    assert z2.device == {"params": 2000, "grads": 500, "master": 1000, "optimizer": 2000}
    z3 = model_state_bytes(1000, 4, 3, **kw)  # + params 2·250, gathered unit 2·100
    assert z3.device == {"params": 500, "grads": 500, "master": 1000, "optimizer": 2000}
    assert z3.gathered == 200 and z3.device_total == 4200
    o2 = model_state_bytes(1000, 4, 2, offload=True, **kw)
    assert o2.device == {"params": 2000, "grads": 0, "master": 0, "optimizer": 0}
    assert o2.host == {"params": 0, "grads": 500, "master": 1000, "optimizer": 2000}
    assert (o2.device_total, o2.host_total, o2.total) == (2000, 3500, 5500)
    o3 = model_state_bytes(1000, 4, 3, offload=True, **kw)
    assert o3.device["params"] == 500 and o3.device_total == 700 and o3.host_total == 3500


def test_fp32_offload_keeps_a_host_param_shard():
    # fp32 has no master copy, but the CPU optimizer needs the params it updates: 4·250.
    o = estimate(1000, 4, 2, precision="fp32", offload=True)
    assert o.device["params"] == 4000 and o.host == {
        "params": 0, "grads": 1000, "master": 1000, "optimizer": 2000}
    with pytest.raises(ValueError, match="stage 2 or 3"):
        model_state_bytes(1000, 4, 1, offload=True, **MIXED)


def test_zero_paper_example():
    # 7.5B params, 64 GPUs, K = 12: 16Ψ; 4Ψ + 12Ψ/64; 2Ψ + 14Ψ/64; 16Ψ/64 (GB = 1e9).
    psi = 7_500_000_000
    totals = [estimate(psi, 64, s).device_total for s in range(4)]
    assert totals == [120_000_000_000, 31_406_250_000, 16_640_625_000, 1_875_000_000]
    assert [round(t / 1e9, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


def test_reductions_approach_4x_8x_nx():
    psi = 2**30
    prev = (0.0, 0.0)
    for n in (2, 8, 64, 512, 4096):
        ddp, z1, z2, z3 = (estimate(psi, n, s).device_total for s in range(4))
        r1, r2 = ddp / z1, ddp / z2  # 16/(4+12/N) and 16/(2+14/N)
        assert r1 > prev[0] and r2 > prev[1] and r1 < 4 and r2 < 8
        assert ddp / z3 == n
        prev = (r1, r2)
    assert prev[0] == pytest.approx(4, rel=0.01) and prev[1] == pytest.approx(8, rel=0.01)


def test_padding_is_exact_for_uneven_buffers():
    bufs, n = [10, 7, 1], 4  # shards ceil: 3 + 2 + 1 = 6; padded 12 + 8 + 4 = 24 = 18 + 6
    for p in bufs:
        padded = torch.nn.functional.pad(torch.ones(p), (0, (-p) % n))
        assert all(c.numel() == shard_numel(p, n) for c in padded.chunk(n))
    z2 = model_state_bytes_from_buffers(bufs, n, 2, **MIXED)
    assert z2.device == {"params": 2 * 18, "grads": 2 * 6, "master": 4 * 6, "optimizer": 8 * 6}
    assert z2.padding_elems == 6
    full = model_state_bytes_from_buffers(bufs, n, 2, pad_full=True, **MIXED)
    assert full.device["params"] == 2 * 24
    # one merged buffer pads less: ceil(18/4) = 5
    assert model_state_bytes(18, n, 2, **MIXED).device["grads"] == 2 * 5
    assert model_state_bytes_from_buffers(bufs, n, 0, **MIXED).padding_elems == 0


# ----------------------------------------------------------------------------- traffic


def test_traffic_per_stage():
    # Ψ = 1000, N = 4: (N−1)/N·Ψ = 750 elements per collective phase.
    ddp = traffic_per_step(1000, 4, 0, param_bytes=2, grad_bytes=2)
    assert ddp.sent_numel == 1500 and ddp.sent_bytes == 3000  # 2(N−1)/N·Ψ
    for st in (1, 2):
        t = traffic_per_step(1000, 4, st, param_bytes=2, grad_bytes=4)
        assert [c.op for c in t.collectives] == ["reduce_scatter", "all_gather"]
        assert t.sent_numel == 1500 and t.sent_bytes == 750 * 4 + 750 * 2
    z3 = traffic_per_step(1000, 4, 3, param_bytes=2, grad_bytes=2)
    assert z3.sent_numel == 2250 and z3.sent_bytes == 4500  # 3(N−1)/N·Ψ
    o3 = traffic_per_step(1000, 4, 3, param_bytes=2, grad_bytes=2, offload=True)
    assert o3.sent_bytes == 4500 and o3.device_to_host_bytes == 500 == o3.host_to_device_bytes
    assert traffic_per_step(1000, 1, 3, param_bytes=2, grad_bytes=2).sent_bytes == 0
    # uneven: 1001 elements pad to 1004 → chunks of 251, 3 sent per phase
    assert traffic_per_step(1001, 4, 0, param_bytes=2, grad_bytes=2).sent_numel == 2 * 3 * 251


def test_alpha_beta_naive_vs_ring():
    # S = 1e9 fp32 elements = 4e9 bytes, N = 8, β = 100 GB/s, α = 10 µs
    ring = collective_cost("all_reduce", 10**9, 8, 4)
    naive = collective_cost("all_reduce", 10**9, 8, 4, algorithm="naive")
    assert ring.time_s(100, 10) == pytest.approx(2 * 7 * (10e-6 + 4e9 / (8 * 100e9)))
    assert naive.time_s(100, 10) == pytest.approx(7 * (10e-6 + 4e9 / 100e9))
    assert naive.sent_bytes == 7 * 4 * 10**9 and ring.sent_bytes == 2 * 7 * 4 * 10**9 // 8


# ----------------------------------------------------------------------------- counting


def _gpt_formula(c: ModelConfig) -> int:
    h, m = c.n_embd, c.mlp_ratio
    block = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * (m * h * h) + m * h + h
    head = 0 if c.tie_weights else c.vocab_size * h
    return c.vocab_size * h + c.block_size * h + c.n_layer * block + 2 * h + head


def test_param_count_on_meta_and_units():
    big = ModelConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048, vocab_size=50304)
    psi, largest = model_size(big)
    assert psi == _gpt_formula(big)  # ~6.6B, counted without allocating
    for tie in (True, False):
        c = ModelConfig(n_layer=3, n_embd=32, n_head=4, tie_weights=tie)
        model = GPT(c)
        assert count_params(model) == model.num_params() == model_size(c)[0] == _gpt_formula(c)
        units = unit_numels(lambda c=c: GPT(c))
        assert set(units) == {"root", "block0", "block1", "block2"}
        assert sum(units.values()) == _gpt_formula(c)
        assert units["root"] == 256 * 32 * (1 if tie else 2) + 128 * 32 + 2 * 32
    # the root unit (embeddings 50304·4096 + 2048·4096, ln_f) outweighs a block (12h² + 13h)
    assert largest == (50304 + 2048 + 2) * 4096 > 12 * 4096**2 + 13 * 4096


# ----------------------------------------------------------------------------- activations


def _saved_bytes(model: GPT, idx: torch.Tensor, tgt: torch.Tensor) -> dict:
    """Unique saved-tensor storages per block ('root' = outside blocks), params excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where, seen = ["root"], {}
    hooks = []
    for i, b in enumerate(model.blocks):
        hooks.append(b.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i)))
        hooks.append(b.register_forward_hook(lambda m, a, o: where.__setitem__(0, "root")))

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = (where[0], s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, tgt)
    for h in hooks:
        h.remove()
    out: dict = {}
    for key, n in seen.values():
        out[key] = out.get(key, 0) + n
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_formula_matches_saved_tensors(dtype):
    """Exact in fp32; in bf16 CPU LayerNorm keeps mean/rstd in bf16 where the formula
    (CUDA convention) says fp32, so we allow 10%."""
    c = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=256)
    torch.manual_seed(0)
    model = GPT(c).to(dtype).train()
    b, s, ab = 3, 32, 4 if dtype == torch.float32 else 2
    idx, tgt = torch.randint(0, 256, (2, b, s))
    got = _saved_bytes(model, idx, tgt)
    block = block_activation_bytes(b, s, 64, 4, act_bytes=ab)
    head = head_activation_bytes(b, s, 64, 256, act_bytes=ab)
    rel = 0 if dtype == torch.float32 else 0.1
    for i in range(c.n_layer):
        assert got[i] == pytest.approx(block, rel=rel)
    assert got["root"] == pytest.approx(head, rel=rel)
    assert activation_parts(c, b, s, act_bytes=ab).saved == 2 * block + head
    assert block == (16 * b * s * 64) * ab + (4 + 4) * b * s * 4  # (8+2·4)bsh + stats, lse


def test_checkpointing_keeps_only_block_inputs():
    c = ModelConfig(n_layer=3, n_head=4, n_embd=64, block_size=32, activation_checkpointing=True)
    model = GPT(c).train()
    b, s = 2, 32
    idx, tgt = torch.randint(0, 256, (2, b, s))
    got = _saved_bytes(model, idx, tgt)
    inp = b * s * 64 * 4
    head = head_activation_bytes(b, s, 64, 256, act_bytes=4)
    # nothing saved inside the blocks but their inputs (checkpoint() keeps each one; it
    # runs inside the block's forward: models/checkpointing.py)
    assert got == {"root": head, 0: inp, 1: inp, 2: inp}
    # what the model says is kept: the block inputs and the head (memory/activations.py;
    # the peak, with backward's transients, is held to measured peaks in
    # test_long_sequence.py)
    assert activation_parts(c, b, s, act_bytes=4).saved == 3 * inp + head
    assert activation_bytes(c, b, s, act_bytes=4) < activation_bytes(
        c, b, s, act_bytes=4, checkpointing=False)
