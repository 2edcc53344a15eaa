"""One RunShape for the engine and the estimate (issue 22, W2).

`Engine.memory_phases` and `zerotrain estimate` predict each phase's peak through the
same code path (`zero.run_shape` → `memory.phase_estimates`); here the two are compared
for every stage, with and without Offload, Muon and the FP8 all-gather, after a real
step. The shape is also held against the live strategy it describes (buffer sizes,
largest unit, widest parameter), and the stage declarations against SPEC §6's table.
"""

from __future__ import annotations

import pytest
import torch

from zerotrain.cli.estimate import predict_peaks
from zerotrain.config import build_config
from zerotrain.memory import STAGE_SHARDS, activation_bytes, can_offload
from zerotrain.zero import PLACEMENTS, STAGES, Kind, run_shape

MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 64}

CASES = [
    ({"zero": {"stage": 0}}, "stage 0"),
    ({"zero": {"stage": 1}}, "stage 1"),
    ({"zero": {"stage": 2}}, "stage 2"),
    ({"zero": {"stage": 3}}, "stage 3"),
    ({"zero": {"stage": 2, "offload_optimizer": "cpu"}}, "stage 2 + offload"),
    ({"zero": {"stage": 3, "offload_optimizer": "cpu"}}, "stage 3 + offload"),
    ({"zero": {"stage": 0}, "optimizer": {"name": "muon"}}, "muon stage 0"),
    ({"zero": {"stage": 2}, "optimizer": {"name": "muon"}}, "muon stage 2"),
    ({"zero": {"stage": 3, "offload_optimizer": "cpu"}, "optimizer": {"name": "muon"}},
     "muon stage 3 + offload"),
    ({"zero": {"stage": 3}, "precision": {"dtype": "bf16",
                                          "fp8": {"enabled": True, "all_gather": True}}},
     "fp8 all-gather"),
]


def test_stage_declarations_are_the_spec_table():
    # every resident kind the builder can make: a stage class and a home (the disk home is
    # zero3-nvme, its own name); offloading kinds only where the facts allow them
    kinds = {(stage, bool(PLACEMENTS[p].offloads)): Kind(cls, PLACEMENTS[p])
             for stage, cls in STAGES.items() for p in ("none", "cpu")
             if not PLACEMENTS[p].offloads or can_offload(cls.shards)}
    for (stage, off), cls in kinds.items():
        assert cls.shards == STAGE_SHARDS[stage], cls.name
        assert bool(cls.offloads) == off, cls.name
        # checkpoints record these names: the placement's suffix keeps them as they were
        assert cls.name == ("ddp" if stage == 0 else f"zero{stage}") + "-offload" * off
    for stage in STAGE_SHARDS:
        assert ((stage, True) in kinds) == (stage >= 2)  # Offload: sharded gradients


@pytest.mark.parametrize("extra,label", CASES, ids=[c[1] for c in CASES])
def test_engine_and_estimate_predict_the_same_phases(extra, label):
    from zerotrain.engine import Engine
    from zerotrain.models import build_model

    cfg = build_config({"model": MODEL, "data": {"micro_batch_size": 2},
                        "zero": {"bucket_mb": 0.01}, "train": {"device": "cpu"}} | {
        k: {**({"bucket_mb": 0.01} if k == "zero" else {}), **v} for k, v in extra.items()})
    torch.manual_seed(0)
    eng = Engine(build_model(cfg.model, device="meta"), cfg, torch.device("cpu"))
    try:
        x = torch.randint(0, 64, (2, 16))
        eng.backward(eng(x, x))
        assert eng.step() is not None
        s = eng.strategy
        # the shape describes the live strategy, computed without reading it
        shape = run_shape(s.kind, cfg, eng.module, eng.plan, "cpu", 1)
        assert list(shape.buffer_numels) == s.buffer_numels()
        assert shape.largest_unit == max(u.numel for u in s.units)
        assert shape.widest_param == max(sl.numel for u in s.units for sl in u.slots)
        assert (shape.shards, shape.offloads) == (s.shards, s.offloads)
        act = activation_bytes(cfg.model, 2, 16, act_bytes=2 if "fp8" in label else 4)
        got = eng.memory_phases(activations=act)["predicted"]
        want = predict_peaks(cfg, 1, cfg.zero.stage, cfg.zero.offload_optimizer != "none",
                             device="cpu", micro_batch=2, seq=16)
        assert set(got) >= {"init", "forward", "backward", "step"}
        assert got == {k: want["phases"][k] for k in got}, label
        assert want["buffer_numels"] == s.buffer_numels()
    finally:
        eng.close()
