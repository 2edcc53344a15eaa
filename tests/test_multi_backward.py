"""Several backward() calls before one step(), as DeepSpeedExamples' GAN does with one
engine per network: the update applies g1 + g2 — what one process applies — at every
stage and world size, and gradient another engine's backward leaves in this engine's
weights is cleared by `module.zero_grad()`, as in plain torch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multirank import run_ranks

BATCH, STEPS, LR = 8, 3, 0.1


def _nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    d = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    g = nn.Sequential(nn.Linear(3, 12), nn.Tanh(), nn.Linear(12, 6))
    return d, g


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 3, generator=gen)


def _gan_step(d, g, real, noise, backward_d, step_d, backward_g, step_g) -> None:
    """One iteration of DCGAN's loop (DeepSpeedExamples/gan), with the engines' calls."""
    crit = nn.BCEWithLogitsLoss()
    d.zero_grad()
    out = d(real).view(-1)
    backward_d(crit(out, torch.ones_like(out)))
    fake = g(noise)
    out = d(fake.detach()).view(-1)
    backward_d(crit(out, torch.zeros_like(out)))
    step_d()
    g.zero_grad()
    out = d(fake).view(-1)  # G's backward runs through D: gradient lands in D's weights
    backward_g(crit(out, torch.ones_like(out)))
    step_g()


def _plain() -> dict[str, torch.Tensor]:
    d, g = _nets()
    od, og = torch.optim.SGD(d.parameters(), lr=LR), torch.optim.SGD(g.parameters(), lr=LR)
    for step in range(STEPS):
        real, noise = _data(step)
        _gan_step(
            d, g, real, noise, lambda x: x.backward(), od.step, lambda x: x.backward(), og.step
        )
    return _params(d, g)


def _params(d: nn.Module, g: nn.Module) -> dict[str, torch.Tensor]:
    out = {f"d.{k}": v.detach().clone() for k, v in d.state_dict().items()}
    return out | {f"g.{k}": v.detach().clone() for k, v in g.state_dict().items()}


def _engines(stage: int) -> dict[str, torch.Tensor]:
    import zerotrain.deepspeed as deepspeed
    from zerotrain.comm.dist import world

    rank, n = world()
    d, g = _nets()
    ds = {
        "train_batch_size": BATCH,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engines = []
    for net in (d, g):
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        eng, *_ = deepspeed.initialize(model=net, optimizer=opt, config=ds)
        engines.append(eng)
    ed, eg = engines
    b = BATCH // n
    for step in range(STEPS):
        real, noise = _data(step)
        rows = slice(rank * b, (rank + 1) * b)
        _gan_step(d, g, real[rows], noise[rows], ed.backward, ed.step, eg.backward, eg.step)
    with ed.full_parameters(), eg.full_parameters():
        out = _params(d, g)
    ed.close()
    eg.close()
    return out


def _all_stages() -> list[dict[str, torch.Tensor]]:
    return [_engines(stage) for stage in (0, 1, 2, 3)]


@pytest.mark.parametrize("world", [1, 2])
def test_several_backwards_before_a_step_accumulate_as_one_process(world):
    want = _plain()
    res = _all_stages() if world == 1 else run_ranks(_all_stages, world)[0]
    for stage, got in zip((0, 1, 2, 3), res, strict=True):
        for k, v in want.items():
            assert torch.allclose(got[k], v, rtol=1e-5, atol=1e-6), (stage, k, got[k], v)


def test_module_zero_grad_clears_the_engines_gradients_a_copy_only_its_own():
    import copy

    import zerotrain.deepspeed as deepspeed

    net = nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    eng, *_ = deepspeed.initialize(model=net, optimizer=opt, config={"train_batch_size": 2})
    eng.backward(net(torch.randn(2, 4)).sum())
    kept = eng.strategy.units[0].grad
    assert float(kept.abs().sum()) > 0
    copy.deepcopy(net).zero_grad()  # an EMA copy: not this engine's model
    assert float(kept.abs().sum()) > 0
    net.zero_grad()
    assert float(kept.abs().sum()) == 0
    eng.close()
