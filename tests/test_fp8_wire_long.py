"""ZeRO-3's FP8 all-gather over a run long enough for the weights' amaxes to cross powers
of two: every rank must decode each weight with this step's scale (review 3, W-1), so
the run stays bit-identical to plain FP8 at every world size."""

from __future__ import annotations

import pytest
import torch

from multirank import run_ranks
from zero_harness import run_many

STEPS = 33  # 30 past the 3-step warmup: the 6-step test never left the warmup
PLAIN = {
    "precision": {"dtype": "bf16", "fp8": {"enabled": True, "recipe": "tensorwise"}},
    "zero": {"stage": 3},
    "model": {"bias": False, "n_layer": 1},
    "schedule": {"warmup_steps": 3, "min_lr": 1e-2},
}
WIRED = {
    **PLAIN,
    "precision": {
        "dtype": "bf16",
        "fp8": {"enabled": True, "recipe": "tensorwise", "all_gather": True},
    },
}


@pytest.mark.parametrize("world", [2, 3])
def test_fp8_all_gather_bit_identical_for_30_steps_past_warmup(world):
    plain, wired = run_ranks(run_many, world, [PLAIN, WIRED], STEPS)[0]
    assert len(plain["losses"]) == STEPS
    first = next(
        (i for i, (a, b) in enumerate(zip(plain["losses"], wired["losses"])) if a != b), None
    )
    assert first is None, f"losses part at step {first}"
    for k in plain["params"]:
        assert torch.equal(plain["params"][k], wired["params"][k]), k


def test_fp8_wire_scale_of_a_foreign_weight_follows_its_amax():
    """Unit level: rank 0 holds no piece of `o`; its scale must follow o's amax."""
    from torch import nn

    from zerotrain.numerics.fp8 import FP8_E4M3, scale_from_amax
    from zerotrain.zero.flat import FlatUnit
    from zerotrain.zero.params.fp8_wire import Fp8Wire
    from zerotrain.zero.partition import Partition

    a, b = nn.Parameter(torch.randn(64, 64)), nn.Parameter(torch.randn(64, 64))
    u = FlatUnit.build(
        0, "blk", [("blk.q.weight", a, 0), ("blk.o.weight", b, 0)], Partition(2, 0), 8
    )
    u.wire = Fp8Wire(u, {"blk.q.weight", "blk.o.weight"}, 2)
    assert "blk.o.weight" not in {p.fp8 for p in u.wire.chunks[0]}
    u.shard = torch.randn(u.shard_numel).bfloat16()
    for amax in (1.0, 8.0, 0.25):
        u.wire.pack(
            u.shard, {"blk.q.weight": torch.tensor(1.0), "blk.o.weight": torch.tensor(amax)}
        )
        want = scale_from_amax(torch.tensor(amax), FP8_E4M3)
        assert float(u.wire.scales["blk.o.weight"]) == float(want), amax


def _tiered(path: str, steps: int) -> list[dict]:
    def tier(kind: str) -> dict:
        zero = {"stage": 3, "offload_param": kind}
        if kind == "nvme":
            zero |= {"nvme_path": path, "nvme_block_mb": 0.0625}
        return {**WIRED, "zero": zero}

    return run_many([WIRED, tier("nvme"), tier("cpu")], steps)


@pytest.mark.parametrize("world", [1, 2])
def test_fp8_all_gather_with_a_parameter_tier_equals_no_tier(tmp_path, world):
    """C-2: the shards live in the tier between uses; the wire packs at each gather from
    the shard made ready, so Engine.__init__ no longer slices a released storage and the
    run is the no-tier run bit for bit (several steps: the packed bytes follow updates)."""
    steps = 6
    if world == 1:
        res = _tiered(str(tmp_path), steps)
    else:
        res = run_ranks(_tiered, world, str(tmp_path), steps)[0]
    ref, *rest = res
    for kind, r in zip(("nvme", "cpu"), rest, strict=True):
        assert r["losses"] == ref["losses"], kind
        for k, v in ref["params"].items():
            assert torch.equal(r["params"][k], v), (kind, k)
    assert ref["losses"][-1] < ref["losses"][0]
