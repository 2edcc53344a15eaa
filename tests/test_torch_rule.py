"""torch.optim.Adam / AdamW's arithmetic on zerotrain's shards, bit for bit
(`zerotrain.optim.torch_rule`): what DeepSpeed steps when the HF Trainer hands it
`torch.optim.AdamW(fused=True)`, so that `save_model` after 30 updates equals DeepSpeed's
weights exactly. The reference is torch.optim itself, on whole tensors; ours runs on
tensors cut at odd places (a shard boundary can fall anywhere)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import zerotrain.deepspeed as deepspeed
from zerotrain.optim.torch_rule import torch_adam_

STEPS = 32


def _lr(k: int) -> float:  # a warm-up from 0, as the Trainer's first update
    return 1e-3 * min(1.0, (k - 1) / 5)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("decoupled", [True, False])
def test_update_equals_torch_optim_bit_for_bit(fused, decoupled):
    torch.manual_seed(0)
    n = 16 * 301  # a multiple of the SIMD width: torch's fused kernel has no scalar tail
    p0 = torch.randn(n)
    grads = [torch.randn(n) * 10.0 ** (-k % 6) for k in range(STEPS)]
    ref = nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(
        [ref], lr=1e-3, weight_decay=0.01, fused=fused or None, foreach=None if fused else False
    )
    cuts = [0, 3, 17, n // 2 + 5, n]
    parts = list(itertools.pairwise(cuts))
    ps = [p0[a:b].clone() for a, b in parts]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    steps = [torch.tensor(0.0) for _ in ps]
    for k, g in enumerate(grads, 1):
        opt.param_groups[0]["lr"] = _lr(k)
        ref.grad = g.clone()
        opt.step()
        torch_adam_(
            ps,
            [g[a:b].clone() for a, b in parts],
            ms,
            vs,
            steps,
            rule="torch_fused" if fused else "torch",
            lr=_lr(k),
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.01,
            decoupled=decoupled,
        )
    st = opt.state[ref]
    assert torch.equal(torch.cat(ps), ref.detach())
    assert torch.equal(torch.cat(ms), st["exp_avg"])
    assert torch.equal(torch.cat(vs), st["exp_avg_sq"])
    assert [float(s) for s in steps] == [float(STEPS)] * len(ps)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.inp(x))))


def _groups(net: nn.Module) -> list[dict]:
    """The Trainer's two groups: decay for matrices, none for biases and norms."""
    decay = [p for n, p in net.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in net.named_parameters() if not any(p is q for q in decay)]
    return [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]


def _train_beside(engine, ref, ref_opt, sched=None) -> None:
    """STEPS steps of the engine and of the torch reference on the same batches."""
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(4, 16, generator=g), torch.randint(0, 8, (4,), generator=g)
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("fused", [True, False])
def test_client_adamw_through_the_engine_equals_torch(stage, fused):
    """A client torch.optim.AdamW through zerotrain.deepspeed.initialize (the Trainer's
    road), 32 updates with a warm-up: the weights equal torch's own loop exactly."""
    torch.manual_seed(0)
    net = Net()
    ref = Net()
    ref.load_state_dict(net.state_dict())
    kw = {"fused": True} if fused else {"foreach": False}
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-3, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: min(1.0, s / 5))
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": float("inf"),
    }
    opt = torch.optim.AdamW(_groups(net), lr=1e-3, **kw)
    engine, _, _, _ = deepspeed.initialize(
        model=net,
        optimizer=opt,
        config=cfg,
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 5)),
    )
    _train_beside(engine, ref, ref_opt, sched)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        got = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for n, p in ref.named_parameters():
        assert torch.equal(got[n], p.detach()), n


def test_config_adamw_with_torch_adam_equals_torch():
    """The config's AdamW with `torch_adam: true`: DeepSpeed builds torch.optim.AdamW from
    it, so zerotrain updates with torch's single-tensor arithmetic: equal to torch."""
    torch.manual_seed(0)
    net, ref = Net(), Net()
    ref.load_state_dict(net.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 2},
        "steps_per_print": float("inf"),
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True},
        },
    }
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    _train_beside(engine, ref, ref_opt)
    got = dict(engine.module.named_parameters())
    for n, p in ref.named_parameters():
        assert torch.equal(got[n].detach(), p.detach()), n
