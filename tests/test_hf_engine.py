"""The DeepSpeed engine surface that transformers' Trainer, Accelerate and TRL use, on
one process, against independent references (a plain torch copy of the model and
torch.optim.AdamW): the engine as an nn.Module, `engine.config` as the DeepSpeed dict,
Accelerate's accumulation boundary and the Trainer's `scale_wrt_gas=False`, the ZeRO-3
consolidated state dict of `save_model`, the `safe_*` accessors, `zero.Init` /
`GatheredParameters` as `from_pretrained` drives them, the config keys Accelerate
writes, and a Hugging Face `datasets.Dataset` as training_data."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zerotrain.deepspeed as deepspeed
from zerotrain.config.base import ConfigError
from zerotrain.deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)
        self.register_buffer("table", torch.arange(4.0))  # as a rotary table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.inp(x)))) + self.table.sum() * 0


def cfg(stage: int, gas: int = 1, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": stage, **zero}, "steps_per_print": float("inf"),
            "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0; the reference clips not
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g))
            for _ in range(n)]


def loss_of(model, x, y) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def reference_after(ref: nn.Module, micro: list, updates: int) -> nn.Module:
    """torch.optim.AdamW on an untouched copy, grads averaged over each update's micros."""
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    per = len(micro) // updates
    for u in range(updates):
        opt.zero_grad()
        for x, y in micro[u * per:(u + 1) * per]:
            (loss_of(ref, x, y) / per).backward()
        opt.step()
    return ref


@pytest.mark.parametrize("stage", [0, 3])
def test_engine_is_a_module_with_the_deepspeed_config_dict(stage):
    torch.manual_seed(0)
    net = Net()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config=cfg(stage))
    assert isinstance(engine, nn.Module)
    assert [n for n, _ in engine.named_parameters()] == [
        "module.inp.weight", "module.inp.bias", "module.norm.weight", "module.norm.bias",
        "module.head.weight", "module.head.bias"]
    assert all(a is b for a, b in zip(engine.parameters(), net.parameters()))
    assert list(engine.children()) == [net]
    assert isinstance(engine.config, dict)
    assert engine.config["zero_optimization"]["stage"] == stage  # as Trainer.save_model reads
    assert engine.config.zero.stage == stage  # zerotrain's own reads still answer
    x, _ = batches(1)[0]
    torch.testing.assert_close(engine.forward(x), engine(x), rtol=0, atol=0)
    engine.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accelerate_boundary_and_trainer_loss_scaling(stage):
    """Accelerate: set_gradient_accumulation_boundary(sync) before each backward, step()
    only at the boundary; the Trainer divides the loss by the accumulation steps itself
    and passes scale_wrt_gas=False. Two updates of two micro-batches = torch AdamW on the
    averaged gradient."""
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    engine, opt, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                           config=cfg(stage, gas=2))
    micro = batches(4)
    for i, (x, y) in enumerate(micro):
        sync = i % 2 == 1
        engine.set_gradient_accumulation_boundary(sync)
        engine.backward(loss_of(engine, x, y) / 2, scale_wrt_gas=False)
        if sync:
            engine.step()
    assert engine.global_steps == 2 and opt.overflow is False
    reference_after(ref, micro, updates=2)
    sd = engine._zero3_consolidated_16bit_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(sd[name], p.detach(), rtol=1e-5, atol=1e-6)
    engine.close()


def test_no_boundary_no_update():
    torch.manual_seed(0)
    net = Net()
    before = copy.deepcopy(net.state_dict())
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config=cfg(2, gas=2))
    x, y = batches(1)[0]
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(loss_of(engine, x, y))
    engine.step()  # not a boundary: DeepSpeed does nothing
    assert engine.global_steps == 0
    sd = engine._zero3_consolidated_16bit_state_dict()
    assert all(torch.equal(sd[k], v) for k, v in before.items())
    engine.close()


def test_zero3_consolidated_state_dict_and_gather_flag():
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    engine, *_ = deepspeed.initialize(
        model=net, model_parameters=net.parameters(),
        config=cfg(3, stage3_gather_16bit_weights_on_model_save=True))
    assert engine.zero_gather_16bit_weights_on_model_save() is True
    micro = batches(1)
    engine.backward(loss_of(engine, *micro[0]))
    engine.step()
    reference_after(ref, micro, updates=1)
    sd = engine._zero3_consolidated_16bit_state_dict()
    assert list(sd) == list(ref.state_dict())  # parameters and the persistent buffer
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-6)
    assert all(t.device.type == "cpu" for t in sd.values())
    frozen = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    assert set(frozen) == set(sd)  # nothing is frozen here
    engine.close()
    net2 = Net()
    e2, *_ = deepspeed.initialize(model=net2, model_parameters=net2.parameters(),
                                  config=cfg(3))
    assert e2.zero_gather_16bit_weights_on_model_save() is False  # DeepSpeed's default
    e2.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_safe_get_and_set_full_fp32_param(stage):
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config=cfg(stage))
    w = net.head.weight
    torch.testing.assert_close(safe_get_full_fp32_param(w), ref.head.weight.detach(),
                               rtol=0, atol=0)
    new = torch.full_like(ref.head.weight, 0.25)
    safe_set_full_fp32_param(w, new)
    assert torch.equal(safe_get_full_fp32_param(w), new)
    with torch.no_grad():
        ref.head.weight.copy_(new)
    micro = batches(1)
    engine.backward(loss_of(engine, *micro[0]))
    engine.step()  # the update starts from the value set (the master was written)
    reference_after(ref, micro, updates=1)
    torch.testing.assert_close(safe_get_full_fp32_param(w), ref.head.weight.detach(),
                               rtol=1e-5, atol=1e-6)
    engine.close()


def test_zero_init_and_gathered_parameters_as_from_pretrained_drives_them():
    """Parameters meta as registered, buffers real; attributes set on a parameter
    (transformers' `_is_hf_initialized`) survive a GatheredParameters block; a later
    block sees what an earlier one wrote; initialize takes the written values whole."""
    torch.manual_seed(0)
    loaded = Net().state_dict()
    with deepspeed.zero.Init():
        net = Net()
    assert all(p.device.type == "meta" for p in net.parameters())
    assert torch.equal(net.table, torch.arange(4.0))
    params = list(net.parameters())
    assert [p._zt_order for p in params] == list(range(6))
    for name, p in reversed(list(net.named_parameters())):  # any order: a set's
        with deepspeed.zero.GatheredParameters({p}, modifier_rank=0), torch.no_grad():
            p.copy_(loaded[name])
            p._is_hf_initialized = True
    assert all(getattr(p, "_is_hf_initialized", False) for p in net.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        assert torch.equal(net.head.bias, loaded["head.bias"])  # the earlier block's value
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config=cfg(3))
    sd = engine._zero3_consolidated_16bit_state_dict()
    assert all(torch.equal(sd[k], v) for k, v in loaded.items())
    engine.close()


def test_config_keys_accelerate_writes_and_zenflow():
    from zerotrain.deepspeed_config import load_deepspeed_config

    c = cfg(3, stage3_gather_16bit_weights_on_model_save=True)
    load_deepspeed_config(c, 1)  # steps_per_print: Infinity and the gather flag accepted
    bad = cfg(2, offload_optimizer={"device": "cpu"}, zenflow={"topk_ratio": 0.05})
    with pytest.raises(ConfigError) as e:
        load_deepspeed_config(bad, 1)
    assert ("zero_optimization.zenflow.topk_ratio=0.05: a DeepSpeed setting zerotrain does "
            "not implement: ZenFlow") in str(e.value)


def test_hf_datasets_dataset_as_training_data():
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_dict({"x": [[float(i)] * 6 for i in range(8)],
                                       "y": list(range(8))})
    net = Net()
    engine, _, loader, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                                config=cfg(1), training_data=rows)
    got = sorted(int(v) for b in loader for v in b["y"])
    assert got == list(range(8)) and len(loader) == 2  # micro-batches of 4, world 1
    engine.close()


def test_zero1_with_cpu_offload_runs_as_deepspeed_does():
    """HelloDeepSpeed's config: ZeRO-1 + offload_optimizer cpu (DeepSpeed runs it) runs as
    ZeRO-2 + Offload, the same updates as torch AdamW; the engine says stage 1."""
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    engine, *_ = deepspeed.initialize(
        model=net, model_parameters=net.parameters(),
        config=cfg(1, offload_optimizer={"device": "cpu"}))
    assert engine.zero_optimization_stage() == 1
    assert engine.config.zero.offload_optimizer == "cpu"
    micro = batches(2)
    for x, y in micro:
        engine.backward(loss_of(engine, x, y))
        engine.step()
    reference_after(ref, micro, updates=2)
    sd = engine._zero3_consolidated_16bit_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(sd[name], p.detach(), rtol=1e-5, atol=1e-6)
    engine.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_ds_status_says_where_a_parameter_is_whole(stage):
    """TRL reads `ds_status` before using the LM head outside its forward: at ZeRO-3 a
    model with no blocks is one root unit, whole through the forward and backward."""
    from zerotrain.deepspeed.zero import ZeroParamStatus

    net = Net()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config=cfg(stage))
    assert {p.ds_status for p in net.parameters()} == {ZeroParamStatus.AVAILABLE}
    engine.close()
