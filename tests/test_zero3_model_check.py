"""Models zerotrain's ZeRO-3 cannot run as written are refused in one line naming the
setting, before the first update (`zerotrain.deepspeed.zero3_check`). Before the check
these trained on NaN: every update skipped, no error. Models that do work (one block
object listed twice, a block called twice per forward, an HF Llama) still run and match
stage 0."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zerotrain.deepspeed as deepspeed
from zerotrain.config.base import ConfigError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)

    def body(self, h: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            h = b(h)
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)))


class ReadsWeight(Net):  # a block's weight read by the parent
    def forward(self, x):
        h = self.body(self.emb(x))
        return self.head(h + h @ self.blocks[0].fc.weight.T)


class CallsSubmodule(Net):  # a block's submodule called from outside the block
    def forward(self, x):
        h = self.body(self.emb(x))
        return self.head(h + self.blocks[0].fc(h))


class BareParameter(Net):  # a block's own nn.Parameter used by the parent
    def __init__(self):
        super().__init__()
        for b in self.blocks:
            b.scale = nn.Parameter(torch.ones(8))

    def body(self, h):
        for b in self.blocks:
            h = b(h) * b.scale
        return h


class TiedAcrossBlocks(Net):
    def __init__(self):
        super().__init__()
        self.blocks[1].fc.weight = self.blocks[0].fc.weight


class TiedWithRoot(Net):  # a block's weight reused by a module outside the blocks
    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(8, 8)
        self.mix.weight = self.blocks[0].fc.weight

    def forward(self, x):
        return self.head(self.mix(self.body(self.emb(x))))


class SameBlockTwice(Net):  # one block object listed twice: one unit, works
    def __init__(self):
        super().__init__()
        b = Block()
        self.blocks = nn.ModuleList([b, b])


class Recurrent(Net):  # a block called twice per forward: works
    def body(self, h):
        for b in [*self.blocks, self.blocks[0]]:
            h = b(h)
        return h


def _run(cls: type, stage: int, steps: int = 2) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = cls()
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": float("inf"),
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        engine.backward(engine(torch.randn(2, 4, generator=g)).square().mean())
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize(
    ("cls", "name", "when"),
    [
        (ReadsWeight, "blocks.0.fc.weight", "Tensor.T"),
        (CallsSubmodule, "blocks.0.fc.weight", "linear"),
        (BareParameter, "blocks.0.scale", "mul"),
    ],
)
def test_reading_a_block_parameter_outside_the_block_is_refused(cls, name, when):
    with pytest.raises(ConfigError) as e:
        _run(cls, 3)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"zero_optimization.stage=3: {cls.__name__}'s forward reads ")
    assert f"parameter '{name}' outside the forward of its ZeRO-3 unit" in msg
    assert f"(in {when})" in msg
    assert "zero_optimization.stage to 2" in msg
    assert "stage3_param_persistence_threshold" in msg


@pytest.mark.parametrize(
    ("cls", "where", "owner"),
    [
        (TiedAcrossBlocks, "blocks.1.fc.weight", "blocks.0.fc.weight"),
        (TiedWithRoot, "mix.weight", "blocks.0.fc.weight"),
    ],
)
def test_a_parameter_tied_across_units_is_refused_at_initialize(cls, where, owner):
    with pytest.raises(ConfigError) as e:
        _run(cls, 3, steps=0)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"'{where}' is the same tensor as '{owner}' of another ZeRO-3 unit" in msg
    assert "untie them, or set zero_optimization.stage to 2" in msg


@pytest.mark.parametrize("cls", [ReadsWeight, TiedWithRoot, BareParameter])
def test_the_same_models_run_at_stage_2(cls):
    got = _run(cls, 2)
    assert all(torch.isfinite(p).all() for p in got.values())


@pytest.mark.parametrize("cls", [Net, SameBlockTwice, Recurrent])
def test_models_zero3_runs_as_written_still_run_and_equal_stage_0(cls):
    z3, z0 = _run(cls, 3), _run(cls, 0)
    assert z3.keys() == z0.keys()
    for n in z0:
        torch.testing.assert_close(z3[n], z0[n], rtol=0, atol=1e-6)


def test_an_hf_llama_passes_the_check_at_zero3():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ref = copy.deepcopy(model)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": float("inf"),
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    loss = engine(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, ref(input_ids=ids, labels=ids).loss, rtol=0, atol=1e-6)
