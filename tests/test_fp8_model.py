"""FP8 on a whole model (GPT conversion, training) and ZeRO-3's FP8 all-gather primitives."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from zerotrain.config import ModelConfig
from zerotrain.models import plan_for
from zerotrain.models.gpt import GPT
from zerotrain.numerics.codec import decode_tensor, encode_tensor
from zerotrain.numerics.formats import FP8_E4M3
from zerotrain.numerics.fp8 import FP8Recipe, scale_from_amax
from zerotrain.numerics.fp8_gather import dequantize, local_amax, quantize_shard, unit_amaxes
from zerotrain.numerics.fp8_linear import Fp8Linear, convert_to_fp8, revert_fp8
from zerotrain.optim import AdamW

from multirank import run_ranks

RECIPES = ["tensorwise", "rowwise", "delayed"]


def tiny_gpt(seed: int = 0, dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(seed)
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64)
    return GPT(cfg).to(dtype)


def sequences(n: int = 16, t: int = 32) -> tuple[Tensor, Tensor]:
    """Arithmetic progressions mod 64: learnable within a few dozen steps."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randint(0, 64, (n, 1), generator=gen)
    step = torch.randint(1, 4, (n, 1), generator=gen)
    seq = (start + step * torch.arange(t + 1)) % 64
    return seq[:, :-1], seq[:, 1:]


# ---------------------------------------------------------------- conversion
def test_convert_swaps_exactly_the_plan_linears():
    model = tiny_gpt()
    plan = plan_for(model)
    before = dict(model.named_parameters())
    sd_before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = convert_to_fp8(model, plan, FP8Recipe("delayed", amax_history=3))
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert fp8 == set(plan.fp8_linears) and len(fp8) == 8  # qkv, proj, fc, proj × 2 blocks
    assert type(model.head) is nn.Linear and type(model.wte) is nn.Embedding
    assert all(p is before[n] for n, p in model.named_parameters())  # shared, not copied
    assert len(stats.modules) == 8
    sd = model.state_dict()
    extra = set(sd) - set(sd_before)
    assert extra == {f"{n}.fp8_amax_history" for n in fp8}  # delayed: the history only
    assert all(torch.equal(sd[k], v) for k, v in sd_before.items())
    with pytest.raises(ValueError, match="already"):
        convert_to_fp8(model, plan, FP8Recipe())
    x, _ = sequences(2)
    ref = tiny_gpt()(x)
    assert revert_fp8(model) == 8 and torch.equal(model(x), ref) and not stats.modules


def test_convert_rejects_a_non_linear():
    model = tiny_gpt()

    class P:
        fp8_linears = ("blocks.0.ln1",)

    with pytest.raises(TypeError, match=r"nn\.Linear"):
        convert_to_fp8(model, P(), FP8Recipe())


# ---------------------------------------------------------------- training
@pytest.mark.parametrize("recipe", RECIPES)
def test_gpt_in_fp8_matches_fp32_and_trains(recipe):
    """First forward: logits within 2^-5 relative (norm) of the FP32 model — each E4M3
    rounding is ≤ 2^-4 relative, and independent roundings largely cancel in the sums.
    Training 30 AdamW steps: loss falls by > 40% and ends within 2% of FP32's."""
    x, y = sequences()
    curves = {}
    for name in ("fp32", recipe):
        model = tiny_gpt()
        stats = None if name == "fp32" else convert_to_fp8(model, plan_for(model),
                                                           FP8Recipe(recipe))
        with torch.no_grad():
            curves[name + "_logits"] = model(x)
        opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        losses = []
        for _ in range(30):
            loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if stats is not None:
                snap = stats.end_step()
                if recipe != "delayed":  # dynamic scales fit every tensor: never saturate
                    assert all(v["overflow"] == 0 for v in snap.values())
        curves[name] = losses
    ref, got = curves["fp32_logits"], curves[recipe + "_logits"]
    assert float((got - ref).norm() / ref.norm()) < 2.0**-5
    fp8, fp32 = curves[recipe], curves["fp32"]
    assert fp8[-1] < 0.6 * fp8[0]
    assert abs(fp8[-1] - fp32[-1]) < 0.02 * fp32[-1]


def test_bf16_model_in_fp8():
    model = tiny_gpt(dtype=torch.bfloat16)
    convert_to_fp8(model, plan_for(model), FP8Recipe("rowwise"))
    x, y = sequences(4)
    model(x, y).backward()
    w = model.blocks[0].mlp.fc.weight
    assert w.grad.dtype == torch.bfloat16 and bool(torch.isfinite(w.grad).all())


# ---------------------------------------------------------------- FP8 all-gather
def test_quantize_shard_halves_bytes_and_matches_codec():
    w = torch.randn(96, 32) * 0.02
    b, s = quantize_shard(w.bfloat16(), local_amax(w))
    assert b.dtype == torch.uint8 and b.numel() * b.element_size() == w.numel()  # 1 B
    assert b.numel() * b.element_size() * 2 == w.numel() * w.bfloat16().element_size()
    assert s == scale_from_amax(w.abs().max(), FP8_E4M3)
    want = decode_tensor(FP8_E4M3, encode_tensor(FP8_E4M3, w.bfloat16().float() * s)) / s
    got = dequantize(b, s, torch.float32).view_as(w)
    assert torch.equal(got, want.float())
    out = torch.empty_like(w)
    assert dequantize(b, s, torch.float32, out=out) is out and torch.equal(out, got)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_gathered_weight_requantises_losslessly(recipe):
    """With power-of-two scales the layer's re-quantisation of an FP8-gathered weight
    loses nothing; under tensorwise the layer computes exactly what it computes on the
    original weight."""
    torch.manual_seed(0)
    lin = nn.Linear(48, 40)
    b, s = quantize_shard(lin.weight.detach(), local_amax(lin.weight))
    gathered = copy.deepcopy(lin)
    with torch.no_grad():
        gathered.weight.copy_(dequantize(b, s, torch.float32).view_as(lin.weight))
    a, g = Fp8Linear.from_linear(lin, FP8Recipe(recipe)), Fp8Linear.from_linear(
        gathered, FP8Recipe(recipe))
    w8, sw = g.cast(g.weight.detach(), 1, FP8_E4M3, recipe == "rowwise")
    assert torch.equal(w8.float() / sw, g.weight.detach())  # exact: nothing re-rounded
    x = torch.randn(8, 48)
    if recipe == "tensorwise":
        assert torch.equal(a(x), g(x))


def _gather_worker(params: list[Tensor]) -> tuple[list[Tensor], int]:
    """ZeRO-3 style: params laid end to end in a flat buffer cut into equal shards; each
    rank quantises its piece of each param with that param's all-reduced amax."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [p.numel() for p in params]
    flat = torch.cat([p.flatten() for p in params]).to(torch.bfloat16)
    per = -(-flat.numel() // world)
    flat = torch.nn.functional.pad(flat, (0, per * world - flat.numel()))
    lo, hi = rank * per, (rank + 1) * per
    pieces, starts, off = [], [], 0  # my piece of each param (maybe empty)
    for n in sizes:
        a, b = max(off, lo), min(off + n, hi)
        pieces.append(flat[a:max(a, b)])
        starts.append(a - lo)
        off += n
    amaxes = unit_amaxes(pieces)
    dist.all_reduce(amaxes, op=dist.ReduceOp.MAX)  # the one small all-reduce
    send = torch.zeros(per, dtype=torch.uint8)
    scales = [quantize_shard(p, amaxes[i], out=send[starts[i]:starts[i] + p.numel()])[1]
              for i, p in enumerate(pieces)]
    recv = torch.empty(per * world, dtype=torch.uint8)
    dist.all_gather_into_tensor(recv, send)
    out, off = [], 0
    for n, s, p in zip(sizes, scales, params):
        out.append(dequantize(recv[off:off + n], s, torch.bfloat16).view_as(p))
        off += n
    return out, send.numel() * send.element_size()


@pytest.mark.slow
def test_fp8_all_gather_on_two_ranks_equals_single_process():
    torch.manual_seed(0)
    # two weights of very different ranges and an odd size, so shards cut through them
    params = [torch.randn(24, 16) * 3.0, torch.randn(7, 5) * 1e-3, torch.randn(40, 8) * 0.02]
    results = run_ranks(_gather_worker, 2, params)
    for p_i, p in enumerate(params):
        p16 = p.to(torch.bfloat16)
        b, s = quantize_shard(p16, local_amax(p16))
        want = dequantize(b, s, torch.bfloat16).view_as(p)
        for gathered, _ in results:
            assert torch.equal(gathered[p_i], want)
    per = -(-sum(p.numel() for p in params) // 2)  # shard length, padding included
    sent = sum(nbytes for _, nbytes in results)
    bf16_sent = 2 * per * torch.bfloat16.itemsize  # the same shards gathered in bf16
    assert sent == 2 * per and 2 * sent == bf16_sent  # 1 B per element: half of bf16
