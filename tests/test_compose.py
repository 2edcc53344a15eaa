"""The parts a strategy is composed from (docs/design.md §compose): the placement, chosen
once and handed to the stage, and the wire, chosen in zero/wire.py from the config."""

from __future__ import annotations

import torch

from zerotrain.config import build_config
from zerotrain.models import build_model, plan_for
from zerotrain.zero import HostOffload, OnDevice, strategy_class
from zerotrain.zero.wire import Fp8Gather, PlainWire, choose_wire
from zerotrain.zero.zero2 import ZeRO2
from zerotrain.zero.zero3 import ZeRO3

MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 64}


def test_offload_is_a_placement_of_the_plain_stage_class():
    for stage, cls in ((2, ZeRO2), (3, ZeRO3)):
        kind = strategy_class(build_config({"zero": {"stage": stage,
                                                     "offload_optimizer": "cpu"}}).zero)
        assert (kind.stage_class, kind.placement) == (cls, HostOffload)
        assert kind.name == f"zero{stage}-offload"
        plain = strategy_class(build_config({"zero": {"stage": stage}}).zero)
        assert (plain.stage_class, plain.placement) == (cls, OnDevice)
        assert plain.offloads == frozenset() and plain.name == f"zero{stage}"
    host = HostOffload(torch.device("cpu"))
    assert host.host.type == "cpu" and not host.steps_by_unit  # a CPU rank: no machinery
    assert host.offloads == {"grads", "master", "optimizer"}


def test_the_wire_is_chosen_from_the_config_in_wire_py():
    cfg = build_config({"model": MODEL, "precision": {"dtype": "bf16", "fp8": {
        "enabled": True, "all_gather": True}}, "zero": {"stage": 3}})
    model = build_model(cfg.model, device="meta")
    plan = plan_for(model)
    wire = choose_wire(ZeRO3.shards, plan, cfg.zero, fp8_gather=True)
    assert isinstance(wire, Fp8Gather)
    assert wire.fp8_weights == {f"{m}.weight" for m in plan.fp8_linears} != set()
    # only ZeRO-3 gathers parameters: other stages, or no FP8 gather, travel plain
    assert type(choose_wire(ZeRO2.shards, plan, cfg.zero, fp8_gather=True)) is PlainWire
    assert type(choose_wire(ZeRO3.shards, plan, cfg.zero)) is PlainWire
