"""Tiles meet masked labels: SFT-style prompt labels (-100 over the first three quarters)
under Ulysses sequence parallelism with a tiled loss leave one rank's slice with no
target; its loss is 0, not 0/0, so SP = 2 tiled trains as SP = 1 (review 3, W-4). And
the tiles' gradients are summed in fp32 (W-5): tiled bf16 is as close to the fp32
gradient as untiled bf16 is, not √tiles times farther."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from test_sequence_parallel import SEQ, VOCAB, B, config, hf_llama_folder
from zerotrain.models.tiling import tiled_lm_loss, tiled_mlp

from multirank import run_ranks
from zero_harness import built_engine

STEPS = 4


def sft_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(77 + step)
    x = torch.randint(0, VOCAB, (B, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (B, SEQ), generator=g)
    y[:, : 3 * SEQ // 4] = -100  # the prompt: rank 0's half of the sequence has no target
    return x, y


def _train(folder: str, sp: int, tile: int | None) -> dict:
    cfg = config("hf", folder, 2, sp, {"sequence": {"tile_tokens": tile}})
    eng = built_engine(cfg)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = sft_batch(step)
        loss = eng(x, y)
        eng.backward(loss)
        info = eng.step()
        losses.append(loss.item())
        norms.append(info.grad_norm)
    eng.close()
    return {"losses": losses, "norms": norms}


def _cases(folder: str) -> list[dict]:
    return [_train(folder, 1, None), _train(folder, 2, 16)]


def test_sp2_tiled_sft_labels_equal_sp1(tmp_path):
    folder = hf_llama_folder(tmp_path)
    for one, run in run_ranks(_cases, 2, folder):
        assert all(math.isfinite(n) for n in run["norms"]), run["norms"]
        for a, b in zip(run["losses"], one["losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (run["losses"], one["losses"])
        for a, b in zip(run["norms"], one["norms"], strict=True):
            assert abs(a - b) <= 1e-4 * abs(b), (run["norms"], one["norms"])


def test_tiled_loss_of_a_slice_with_no_target_has_finite_gradients():
    torch.manual_seed(0)
    h = torch.randn(1, 8, 16, requires_grad=True)
    head = nn.Linear(16, 32, bias=True)
    loss = tiled_lm_loss(h, head, torch.full((1, 8), -100), 4)
    (loss.nan_to_num(0.0) * 0.0).backward()  # what SP does with such a slice's mean
    assert loss.item() == 0.0
    for g in (h.grad, head.weight.grad, head.bias.grad):
        assert torch.equal(g, torch.zeros_like(g))


def _rel(g: torch.Tensor, ref: torch.Tensor) -> float:
    return float((g.float() - ref).norm() / ref.norm())


def test_tiles_accumulate_in_fp32():
    torch.manual_seed(0)
    tokens, width, vocab, tile = 1024, 32, 64, 16  # 64 tiles
    h = torch.randn(1, tokens, width).bfloat16()
    t = torch.randint(0, vocab, (1, tokens))
    head = nn.Linear(width, vocab, bias=False).bfloat16()

    def head_grad(m: nn.Module, x: torch.Tensor, tiled: bool) -> torch.Tensor:
        m.weight.grad = None
        if tiled:
            loss = tiled_lm_loss(x, m, t, tile)
        else:
            loss = F.cross_entropy(m(x).view(-1, vocab).float(), t.view(-1))
        loss.backward()
        return m.weight.grad

    ref = head_grad(copy.deepcopy(head).float(), h.float(), False)
    untiled = _rel(head_grad(head, h, False), ref)
    assert _rel(head_grad(head, h, True), ref) <= 1.5 * untiled

    mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
    mlp = mlp.bfloat16()

    def mlp_grads(m: nn.Module, x: torch.Tensor, tiled: bool) -> list[torch.Tensor]:
        m.zero_grad()
        y = tiled_mlp(m, m.forward, x, tile) if tiled else m(x)
        y.float().pow(2).sum().backward()
        return [p.grad for p in m.parameters()]

    refs = mlp_grads(copy.deepcopy(mlp).float(), h.float(), False)
    for r, u, tl in zip(refs, mlp_grads(mlp, h, False), mlp_grads(mlp, h, True), strict=True):
        assert tl.dtype == torch.bfloat16
        assert _rel(tl, r) <= 1.5 * _rel(u, r)
