"""The parts a strategy is composed from (docs/design.md §compose): the placement, chosen
once and handed to the stage, and the wire, chosen in zero/params/wire.py from the config."""

from __future__ import annotations

import torch
from torch import nn

from zerotrain.config import build_config
from zerotrain.models import build_model, plan_for
from zerotrain.zero import HostOffload, OnDevice, strategy_class
from zerotrain.zero.params.wire import Fp8Gather, PlainWire, choose_wire
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


class Shuffled(nn.Module):
    """Blocks used out of their module (and plan) order."""

    ORDER = (2, 0, 3, 1)

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh())
                                    for _ in range(4))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i in self.ORDER:
            h = h + self.blocks[i](h)
        return self.head(h)


def _train_shuffled(prefetch: bool, monkeypatch) -> tuple[list, list, list]:
    """3 steps of ZeRO-3 over `Shuffled`; every real gather logged as (unit, async)."""
    from zerotrain.engine import Engine
    from zerotrain.zero.unit import ShardedUnit, UnitState

    log: list[tuple[str, bool]] = []
    real = ShardedUnit.unshard

    def unshard(self, comm, async_op=True, exact=False, via=None):
        if self.state is UnitState.SHARDED:
            log.append((self.name, async_op))
        return real(self, comm, async_op, exact, via)

    monkeypatch.setattr(ShardedUnit, "unshard", unshard)
    cfg = build_config({"zero": {"stage": 3, "prefetch": prefetch,
                                 "param_persistence_threshold": 0},
                        "train": {"device": "cpu"}})
    torch.manual_seed(0)
    eng = Engine(Shuffled(), cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    losses, logs = [], []
    for _ in range(3):
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
        log.clear()
        loss = nn.functional.cross_entropy(eng(x), y)
        forward = list(log)
        eng.backward(loss)
        logs.append((forward, log[len(forward):]))
        eng.step()
        losses.append(float(loss.detach()))
    masters = [u.master.clone() for u in eng.strategy.units]
    eng.close()
    return losses, masters, logs


def test_zero3_prefetches_the_unit_the_first_forward_ran_next(monkeypatch):
    losses, masters, logs = _train_shuffled(True, monkeypatch)
    used = [f"block{i}" for i in Shuffled.ORDER]
    # after the first forward: root gathered, then each block prefetched (async) in the
    # order the model ran them; backward: root, then the blocks in reverse
    for forward, _ in logs[1:]:
        assert forward == [("root", False)] + [(b, True) for b in used], forward
    for _, backward in logs:
        assert backward == [("root", False)] + [(b, True) for b in used[::-1]], backward
    # the first forward could only guess (the plan's order): block2 was not prefetched
    assert ("block2", False) in logs[0][0]
    ref_losses, ref_masters, _ = _train_shuffled(False, monkeypatch)
    assert losses == ref_losses and len(set(losses)) == 3
    assert all(torch.equal(a, b) for a, b in zip(masters, ref_masters, strict=True))


def test_the_wire_states_its_own_bytes_and_the_estimate_counts_them():
    """`RunShape.gather_bytes` comes from the wire the engine uses: a one-rank ZeRO-3
    engine's FP8 wires pack exactly the bytes `zero.run_shape` predicts for each gathered
    unit, and the estimated parameter all-gathers shrink by that ratio."""
    from zerotrain.engine import Engine
    from zerotrain.memory import shape_traffic
    from zerotrain.zero import run_shape

    shapes = {}
    for fp8 in (False, True):
        cfg = build_config({"model": MODEL, "zero": {"stage": 3}, "precision": {
            "dtype": "bf16", "fp8": {"enabled": True, "all_gather": fp8}}})
        model = build_model(cfg.model, device="meta")
        shapes[fp8] = (cfg, run_shape(strategy_class(cfg.zero), cfg, model, plan_for(model),
                                      "cpu", 1))
    cfg, shape = shapes[True]
    eng = Engine(build_model(cfg.model), cfg, torch.device("cpu"))
    try:
        live = [u.wire.chunk_bytes if u.wire is not None else u.numel * 2
                for u in eng.strategy.units]
    finally:
        eng.close()
    assert sum(u.wire is not None for u in eng.strategy.units) >= 2
    # one rank: its chunk is the whole unit, so the live packing is the unit's wire bytes
    assert list(shape.gather_bytes) == live
    plain = shapes[False][1]
    assert plain.gather_bytes == ()
    sent = {s: {c.what: c.sent_bytes for c in shape_traffic(s, algorithm="ring").collectives}
            for s in (plain, shape)}
    assert sent[plain]["params (fwd)"] == 0 == sent[shape]["params (fwd)"]  # one rank sends nothing
    two = [run_shape(strategy_class(c.zero), c, build_model(c.model, device="meta"),
                     plan_for(build_model(c.model, device="meta")), "cpu", 2)
           for c, _ in (shapes[False], shapes[True])]
    fwd = [next(c.sent_bytes for c in shape_traffic(s).collectives if c.what == "params (fwd)")
           for s in two]
    fp8_bytes, plain_bytes = sum(shape.gather_bytes), sum(n * 2 for n in shape.buffer_numels)
    assert fwd[1] < fwd[0] and abs(fwd[1] / fwd[0] - fp8_bytes / plain_bytes) < 0.01
