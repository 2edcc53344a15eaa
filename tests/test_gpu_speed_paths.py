"""The speed and memory items of the GPU review (S1, S5, S6, S10) and W2, on the CPU.

Each one changes what happens on CUDA only, so each test forces the CUDA branch (a
device argument, a patched device check) or checks the decision itself; correctness is
always held against an independent reference (torch.optim, per-tensor loops, a run
without the change).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from zerotrain.config import build_config
from zerotrain.numerics.precision import apply_tf32, matmul_precision
from zerotrain.optim import AdamW, batching, foreach
from zerotrain.zero.update import UnitByUnit

from multirank import run_ranks

# ----------------------------------------------------------------------------- S1 TF32

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_tf32_choice():
    assert matmul_precision("auto", CUDA, "fp32") == "high"
    assert matmul_precision("auto", CUDA, "bf16") is None  # half precision: nothing to do
    assert matmul_precision("auto", CPU, "fp32") is None
    assert matmul_precision(True, CPU, "bf16") == "high"
    assert matmul_precision(False, CUDA, "fp32") == "highest"
    assert build_config({}).precision.tf32 == "auto"
    assert build_config({"precision": {"tf32": "false"}}).precision.tf32 is False
    with pytest.raises(Exception, match=r"precision\.tf32 must be true, false or auto"):
        build_config({"precision": {"tf32": "sometimes"}})


def test_the_engine_applies_tf32_once_at_start():
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        cfg = build_config({"model": {"n_layer": 1, "n_embd": 16, "n_head": 2,
                                      "block_size": 8}, "train": {"device": "cpu"},
                            "precision": {"tf32": True}})
        Engine(GPT(cfg.model), cfg).close()
        assert torch.get_float32_matmul_precision() == "high"
        assert apply_tf32("auto", CPU, "fp32") is None
        assert torch.get_float32_matmul_precision() == "high"  # auto on CPU leaves it
    finally:
        torch.set_float32_matmul_precision(before)


# ----------------------------------------------------------------------------- S5 chunks


def test_accelerator_chunks_bound_each_call_and_keep_the_result(monkeypatch):
    """Off the CPU the rule runs over chunks of ACCEL_BLOCK_ELEMENTS (shrunk here), so
    its temporaries are chunk-sized, and the update still equals torch.optim.AdamW."""
    assert batching.block_elements(CUDA) == batching.ACCEL_BLOCK_ELEMENTS == 1 << 24
    assert batching.block_elements(CPU) == batching.BLOCK_ELEMENTS
    monkeypatch.setattr(batching, "ACCEL_BLOCK_ELEMENTS", 1000)
    monkeypatch.setattr(batching, "block_elements", lambda device: batching.ACCEL_BLOCK_ELEMENTS)
    sizes = [5_000, 300, 300, 300, 2_345, 7]
    g = torch.Generator().manual_seed(0)
    p0 = [torch.randn(n, generator=g) for n in sizes]
    grads = [[torch.randn(n, generator=g) for n in sizes] for _ in range(3)]
    ours, ref = [p.clone() for p in p0], [p.clone() for p in p0]
    opt = AdamW(ours, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    largest: list[int] = []
    real_blocks = batching._blocks

    def blocks(lists):
        for batch in real_blocks(lists):
            largest.append(sum(t.numel() for t in batch[0]))
            yield batch

    monkeypatch.setattr(batching, "_blocks", blocks)
    for gs in grads:
        for p, q, gr in zip(ours, ref, gs):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt.step()
        ref_opt.step()
    assert max(largest) <= 1000 and sum(largest) == 3 * sum(sizes)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- S10 foreach


def test_foreach_helpers_equal_per_tensor_loops():
    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(n, generator=g) for n in (1000, 3, 0, 77)]
    ts.append(torch.randn(50, generator=g).bfloat16())
    want = torch.zeros((), dtype=torch.float64)
    for t in ts:
        want += torch.linalg.vector_norm(t, dtype=torch.float32).double() ** 2
    got = foreach.sum_of_squares(ts, CPU)
    assert got.dtype == torch.float64 and got.shape == ()
    torch.testing.assert_close(got, want, rtol=1e-7, atol=0)
    scaled = [t.clone() for t in ts]
    foreach.scale_(scaled, 0.37)
    for a, t in zip(scaled, ts):
        assert torch.equal(a, t.clone().mul_(0.37))  # what the per-unit loop does
    foreach.zero_(scaled)
    assert all(not a.any() for a in scaled)


# ----------------------------------------------------------------------------- S6 loop


def test_the_loss_is_read_only_at_log_steps(tmp_path, monkeypatch):
    """train_step keeps the loss on the device (no `.item()` per micro-step: each one
    waits for the GPU) and returns the mean the old per-step floats gave, exactly."""
    from zerotrain.run.loop import train_step
    from zerotrain.run.setup import setup

    text = tmp_path / "c.txt"
    text.write_text("".join(f"line {i}: a quick brown fox\n" for i in range(600)))
    cfg = build_config({"model": {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16},
                        "data": {"path": str(text), "micro_batch_size": 2,
                                 "grad_accum_steps": 3},
                        "train": {"steps": 2, "device": "cpu"},
                        "schedule": {"warmup_steps": 0},
                        "logging": {"run_dir": str(tmp_path / "run"), "progress": False}})
    run = setup(cfg, None)
    seen: list[float] = []
    real_call = type(run.engine).__call__

    def call(self, *a, **k):
        loss = real_call(self, *a, **k)
        seen.append(float(loss.detach()))
        return loss

    items = []
    real_item = torch.Tensor.item

    def item(t):
        if t.requires_grad:
            items.append(t)
        return real_item(t)

    monkeypatch.setattr(type(run.engine), "__call__", call)
    monkeypatch.setattr(torch.Tensor, "item", item)
    _, loss, _ = train_step(run)
    assert items == []
    assert isinstance(loss, torch.Tensor) and loss.dtype == torch.float64
    assert float(loss) == sum(seen) / 3
    run.report.close()
    run.engine.close()


def test_batches_reach_an_accelerator_through_pinned_memory(monkeypatch):
    from zerotrain.data.sampler import to_device

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda t, *a: pinned.append(t.shape) or t.clone())
    x = torch.arange(6).view(2, 3)
    assert to_device(x, torch.device("meta")).device.type == "meta"
    assert pinned == [x.shape]
    assert to_device(x, CPU) is x and len(pinned) == 1  # CPU: no copy at all


# ----------------------------------------------------------------------------- W2


def _compile_fails_on_rank_one() -> dict:
    """Rank 0's compiler works (a stand-in that returns the eager function), rank 1's
    raises: both must end up eager, and their replicas identical."""
    import torch.distributed as dist

    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT

    from zero_harness import batches, local_batch, make_config

    rank = dist.get_rank()

    def broken(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("inductor exploded")
        return run

    torch.compile = (lambda fn, **kw: fn) if rank == 0 else broken
    cfg = make_config({"model": {"n_embd": 64}, "optimizer": {"compile": True},
                       "zero": {"bucket_mb": 25}}, 2, 3)  # one unit: views over 2^16
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
        b = cfg.data.micro_batch_size
        for X, Y in batches(3):  # the compiled update is tried, and voted on, at step 1
            eng.backward(eng(*local_batch(X, Y, rank, 2, b)))
            eng.step()
    out = {"compiled": [g["compiled"] for g in eng.optimizer.param_groups],
           "warnings": [str(w.message) for w in caught],
           "params": {n: p.detach().clone() for n, p in eng.module.named_parameters()}}
    eng.close()
    return out


@pytest.mark.slow
def test_a_compile_failure_on_one_rank_falls_back_on_all():
    r0, r1 = run_ranks(_compile_fails_on_rank_one, 2)
    assert not any(r0["compiled"]) and not any(r1["compiled"])
    assert any("failed on another rank" in w for w in r0["warnings"]), r0["warnings"]
    assert any("failed here" in w and "inductor exploded" in w for w in r1["warnings"])
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name


# ------------------------------------------------------- Offload: publish per unit (S2)


def _by_unit(eng) -> dict:
    """Probe: switch the strategy to Offload-on-GPU's unit-by-unit step, and count the
    optimizer steps and publishes each training step makes, in order."""
    s = eng.strategy
    s.updater = UnitByUnit(s)
    calls: list[str] = []
    step, publish = eng.optimizer.step, s.publish
    eng.optimizer.step = lambda *a, **k: (calls.append("step"), step(*a, **k))[1]
    s.publish = lambda u: (calls.append(f"publish {u.index}"), publish(u))[1]
    return {"calls": calls, "units": len(s.units)}


def _compare_by_unit(cases: list[dict]) -> list[tuple[dict, dict]]:
    from zero_harness import run_many

    return list(zip(run_many(cases, 4), run_many(cases, 4, probe=_by_unit)))


def test_unit_by_unit_step_and_publish_is_the_same_update():
    """Offload on a GPU steps the optimizer one unit at a time and publishes each unit at
    once, so its host-to-device copy overlaps the CPU update of the next: the same
    elementwise update in pieces — bit-identical to the whole-model step, on 2 ranks."""
    cases = [{"zero": {"stage": 2, "offload_optimizer": "cpu"}},
             {"zero": {"stage": 3, "offload_optimizer": "cpu"},
              "data": {"grad_accum_steps": 2}},
             {"zero": {"stage": 1}}]
    for rank_result in run_ranks(_compare_by_unit, 2, cases):
        for case, (whole, pieces) in zip(cases, rank_result):
            assert whole["losses"] == pieces["losses"], case
            assert all(torch.equal(whole["params"][k], pieces["params"][k])
                       for k in whole["params"]), case
            calls, n = pieces["probe"]["calls"], pieces["probe"]["units"]
            # per step: each unit is updated, then published, before the next is updated
            first = calls[: 2 * n]
            assert first == [x for i in range(n) for x in ("step", f"publish {i}")], case
            assert len(calls) == 4 * 2 * n, case  # no second publish after the step
