"""FlatUnit, the layout under every stage: padding, shards, segments, buckets, alignment,
and the slice reassembly (`gather_range`) that resharding and sharded loading use."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from zerotrain.zero.cut import bucket_params
from zerotrain.zero.flat import FlatUnit, gather_range
from zerotrain.zero.partition import Partition


def _named(*specs: tuple[str, tuple[int, ...], int]) -> list:
    return [(n, nn.Parameter(torch.zeros(shape)), g) for n, shape, g in specs]


SPECS = (("a", (3, 4), 0), ("b", (5,), 1), ("c", (2, 3), 0), ("d", (7,), 1))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_padding_and_shards(world):
    u = FlatUnit.build(0, "u", _named(*SPECS), Partition(world, world - 1))
    assert u.numel == 12 + 5 + 6 + 7
    assert u.padded_numel % world == 0 and u.padded_numel - u.numel < world
    assert u.shard_numel * world == u.padded_numel
    assert u.shard_range == ((world - 1) * u.shard_numel, world * u.shard_numel)


def test_parameters_ordered_by_group_then_model_order():
    u = FlatUnit.build(0, "u", _named(*SPECS), Partition(1, 0))
    assert [s.name for s in u.slots] == ["a", "c", "b", "d"]
    assert [s.offset for s in u.slots] == [0, 12, 18, 23]


def test_segments_merge_by_group_or_cut_per_parameter():
    u = FlatUnit.build(0, "u", _named(*SPECS), Partition(1, 0))
    merged = u.segments(0, u.padded_numel)
    assert [(s.group, s.start, s.end) for s in merged] == [(0, 0, 18), (1, 18, 30)]
    per = u.segments(0, u.padded_numel, per_param=True)
    assert [(s.start, s.end) for s in per] == [(0, 12), (12, 18), (18, 23), (23, 30)]
    assert all(s.param is not None for s in per)
    # a shard cutting through parameters: pieces, and only whole ones carry their slot
    cut = u.segments(5, 20, per_param=True)
    assert [(s.start, s.end, s.param is not None) for s in cut] == [
        (5, 12, False), (12, 18, True), (18, 20, False)]


def test_alignment():
    u = FlatUnit.build(0, "u", _named(*SPECS), Partition(2, 0), align=4)
    assert all(s.offset % 4 == 0 for s in u.slots)
    assert [s.offset for s in u.slots] == [0, 12, 20, 28]
    assert u.shard_numel % 4 == 0 and u.padded_numel == 2 * u.shard_numel >= u.numel
    # segments never cover the alignment gaps
    assert sum(s.numel for s in u.segments(0, u.padded_numel)) == 30


def test_buckets_in_reverse_order_bounded_in_size():
    named = _named(("p0", (10,), 0), ("p1", (10,), 0), ("p2", (30,), 0), ("p3", (5,), 0))
    buckets = bucket_params(named, bucket_numel=20)
    assert [[n for n, _, _ in b] for b in buckets] == [["p3"], ["p2"], ["p1", "p0"]]
    # a parameter larger than the bound gets a bucket of its own
    assert all(sum(p.numel() for _, p, _ in b) <= 20 or len(b) == 1 for b in buckets)


def test_gather_range_reassembles_any_cut():
    full = {"a": torch.arange(12.0).view(3, 4), "b": torch.arange(100.0, 105.0)}
    u = FlatUnit.build(0, "u", [("a", nn.Parameter(full["a"]), 0),
                                ("b", nn.Parameter(full["b"]), 0)], Partition(3, 0))

    def read(name, a, b):
        return full[name].reshape(-1)[a:b]

    flat = torch.cat([full["a"].reshape(-1), full["b"]])
    for lo, hi in [(0, 6), (6, 18), (3, 17)]:
        got = gather_range(u.layout(), lo, hi, read, torch.float32)
        want = torch.zeros(hi - lo)
        n = min(hi, 17) - lo
        want[:n] = flat[lo:lo + n]
        assert torch.equal(got, want)


def test_a_sharded_parameter_reads_as_nan_not_freed_memory():
    """Reading a ZeRO-3 parameter outside the hooks used to touch freed storage (a
    segfault on CPU, an illegal memory access on CUDA)."""
    code = textwrap.dedent("""
        import torch
        from zerotrain.engine import Engine
        from zerotrain.models.gpt import GPT
        from zero_harness import batches, make_config
        cfg = make_config({"zero": {"stage": 3}}, 1, 4)
        eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
        X, Y = next(iter(batches(1)))
        eng.backward(eng(X, Y)); eng.step()
        w = eng.module.blocks[0].mlp.fc.weight
        assert w.shape == (128, 32) and bool(torch.isnan(w).all())
        with eng.full_parameters():
            assert bool(torch.isfinite(w).all())
        print("ok")
    """)
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
