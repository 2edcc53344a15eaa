"""Compact model states (issue 32): int8/bf16 optimizer states, bf16 master weights with
Kahan compensation or stochastic rounding — numerics, ranks, resume, bad input."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from zerotrain.checkpoint.io import read_meta, resolve
from zerotrain.checkpoint.reshard import SavedShards
from zerotrain.config import build_config
from zerotrain.engine import Engine
from zerotrain.models.gpt import GPT
from zerotrain.numerics import blockquant as Q
from zerotrain.optim import SGD, AdamW
from zerotrain.optim.compact import Compact

from multirank import run_ranks
from zero_harness import batches, full_params, local_batch, make_config, rel_err, run_many


def _reference(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent fp64 block quantisation: per block of 256, scale = max |x|, each
    element the code (by exhaustive search) nearest to x / scale; also the gap between
    the best and the second-best distance (ties are a coin toss in any precision)."""
    book = Q.SIGNED if signed else Q.UNSIGNED
    x64 = x.double()
    out, margin = torch.empty_like(x64), torch.empty_like(x64)
    for s in range(0, x.numel(), 256):
        blk = x64[s : s + 256]
        scale = blk.abs().max().item()
        y = blk / scale if scale > 0 else blk
        d = (y[:, None] - book[None, :]).abs()
        two = d.topk(2, dim=1, largest=False).values
        out[s : s + 256] = book[d.argmin(dim=1)] * scale
        margin[s : s + 256] = (two[:, 1] - two[:, 0]) / y.abs().clamp(min=1e-12)  # relative
    return out, margin


@pytest.mark.parametrize("signed", [True, False])
def test_int8_blocks_match_fp64_reference(signed: bool) -> None:
    g = torch.Generator().manual_seed(1)
    n = 256 * 7 + 77  # a partial last block
    # magnitudes over 8 decades, so every part of the dynamic map is used
    x = torch.randn(n, generator=g) * 10 ** (-8 * torch.rand(n, generator=g))
    x[256:512] = 0.0  # an all-zero block
    if not signed:
        x = x.abs()
    codes = torch.empty(n, dtype=torch.uint8)
    scales = torch.empty(Q.n_blocks(n))
    Q.quantize_(x, codes, scales, signed)
    got = Q.dequantize(codes, scales, signed).double()
    ref, margin = _reference(x, signed)
    clear = (margin > 1e-6) | (x == 0)
    assert clear.float().mean() > 0.99
    torch.testing.assert_close(got[clear], ref[clear], rtol=1e-6, atol=0)
    assert torch.equal(got[256:512], torch.zeros(256, dtype=torch.float64))
    # the dynamic map: fine steps near the block's maximum (≤ 0.7% of it), and values
    # down to 10^-6 of it kept (never flushed to zero, as a linear map would)
    blk = x.double()[: 256 * 7].view(7, 256)
    y = blk / blk.abs().amax(1, keepdim=True).clamp(min=1e-30)
    err = (got[: 256 * 7].view(7, 256) - blk).abs() / blk.abs().amax(1, keepdim=True)
    assert err[y.abs() >= 0.1].max() < 0.0071
    assert (got[: 256 * 7].view(7, 256)[y.abs() >= 1e-6] != 0).all()


@pytest.mark.parametrize("signed", [True, False])
def test_code_lookup_is_exactly_the_nearest_code(signed: bool) -> None:
    """The step's quantiser finds codes by a bucket lookup on the float's bits; it must
    give the nearest code (bucketize over the midpoints) for every value, including each
    code, each midpoint and the floats a few ulps either side of them."""
    codes, mids, _ = Q.tables(signed, torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    parts = [torch.rand(200_000, generator=g), 10 ** (-9 * torch.rand(200_000, generator=g))]
    for base in (codes.abs(), mids.abs(), torch.tensor([10.0**-k for k in range(10)])):
        for direction in (-1.0, 2.0):
            b = base.clone()
            for _ in range(4):
                b = torch.nextafter(b, torch.full_like(b, direction))
                parts.append(b)
        parts.append(base)
    a = torch.cat([*parts, torch.zeros(1), torch.ones(1)]).clamp(0, 1)
    y = torch.cat([a, -a]) if signed else a
    got = Q.nearest_lookup(y, *Q.lookup(signed, y.device)).long()
    assert torch.equal(got, torch.bucketize(y, mids))
    assert torch.equal(Q.nearest(y, Q.tables(signed, y.device)[2], signed), got)


def test_packed_small_tensors_step_as_if_alone() -> None:
    """Small tensors are packed block-aligned into one scratch per chunk: each must
    step exactly as it would alone (no padding or neighbour leaking into a block)."""
    shapes = [(192,), (5, 77), (256,), (513,), (3,), (1000, 300)]

    def run(together: bool, spec: Compact) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(3)
        dtype = torch.bfloat16 if spec.master_update != "none" else torch.float32
        ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
        opts = [AdamW(ps, lr=1e-2)] if together else [AdamW([p], lr=1e-2) for p in ps]
        for o in opts:
            o.compact = spec
        for _ in range(3):
            for p in ps:
                scale = 10 ** (-3 * torch.rand(1, generator=g))
                p.grad = (torch.randn(p.shape, generator=g) * scale).to(dtype)
            for o in opts:
                o.step()
        return [p.detach().clone() for p in ps] + [
            t for o in opts for st in o.state.values() for t in st.values()
        ]

    for spec in (Compact("int8"), Compact("bf16"), Compact("int8", "kahan")):
        for a, b in zip(run(True, spec), run(False, spec)):
            assert torch.equal(a, b), spec


def test_stochastic_rounding_is_unbiased_and_deterministic() -> None:
    x = torch.full((200_000,), 1.0 + 2**-9)  # a quarter of the way from 1 to the next bf16
    r = Q.stochastic_bf16(x, Q.noise16(0, x.numel(), 7, x.device)).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(r.mean().item() - x[0].item()) < 4e-5
    again = Q.stochastic_bf16(x[1000:2000], Q.noise16(1000, 1000, 7, x.device)).float()
    assert torch.equal(again, r[1000:2000])  # the bits depend on the index only
    # the step's int32 form gives the same bits, also past 2^31 elements and at inf/NaN
    g = torch.Generator().manual_seed(4)
    y = torch.randn(5000, generator=g) * 10 ** (4 * torch.rand(5000, generator=g) - 2)
    y[:3] = torch.tensor([float("inf"), float("nan"), -float("inf")])
    for start in (0, 3 * 2**31 + 5):
        out = torch.empty(5000, dtype=torch.bfloat16)
        Q.stochastic_bf16_(y, out, start, 11)
        ref = Q.stochastic_bf16(y, Q.noise16(start, 5000, 11, y.device))
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


def _tiny_updates(update: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """1,000 SGD steps of 1e-4 each (lr 1e-4 × gradient 1) on weights in [1, 1.5],
    where half a bf16 ulp is 0.004–0.008: every single update is below it. Returns
    how far each weight moved."""
    p = torch.nn.Parameter((1.0 + torch.linspace(0, 0.5, 512)).to(torch.bfloat16).to(dtype))
    start = p.detach().float().clone()
    opt = SGD([p], lr=1e-4)
    opt.compact = Compact("fp32", update)
    for _ in range(1000):
        p.grad = torch.ones_like(p)
        opt.step()
    return p.detach().float() - start


def test_kahan_tracks_fp32_where_plain_bf16_stalls() -> None:
    fp32 = _tiny_updates("none", torch.float32)  # fp32 masters: -0.1 each
    assert torch.allclose(fp32, torch.full_like(fp32, -0.1), atol=1e-4)
    assert _tiny_updates("plain").abs().max() == 0  # plain bf16: every update lost
    for update in ("kahan", "stochastic"):
        moved = _tiny_updates(update)
        # the mean within 2% of fp32's; Kahan's bf16 compensation holds ~16 bits, so
        # single weights stay within 5%
        assert abs(moved.mean().item() / fp32.mean().item() - 1) < 0.02, update
        if update == "kahan":
            assert ((moved - fp32).abs() < 0.005).all()


def test_compact_adamw_close_to_fp32() -> None:
    def run(spec: Compact, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        torch.manual_seed(0)
        target = torch.randn(32, 300)
        p = torch.nn.Parameter(torch.zeros(32, 300, dtype=dtype))
        opt = AdamW([p], lr=1e-2, weight_decay=0.0)
        opt.compact = spec
        for _ in range(60):
            p.grad = (p.float() - target).to(dtype) + 0.1 * torch.randn(32, 300).to(dtype)
            opt.step()
        return p.detach().float()

    fp32 = run(Compact())
    for spec, dtype, tol in (
        (Compact("bf16"), torch.float32, 0.01),
        (Compact("int8"), torch.float32, 0.05),
        (Compact("int8", "kahan"), torch.bfloat16, 0.05),
        (Compact("int8", "stochastic"), torch.bfloat16, 0.06),
    ):
        err = (run(spec, dtype) - fp32).norm() / fp32.norm()
        assert err < tol, (spec, float(err))
    assert math.isfinite(float(fp32.sum()))


# ----------------------------------------------------------------------------- engine runs

INT8 = {"optimizer": {"state_dtype": "int8"}}
BF16_MASTERS = {"precision": {"dtype": "bf16", "master_dtype": "bf16"}}
STEPS = 3
RANK_CASES = [
    *(
        {"optimizer": {"state_dtype": sd}, "zero": {"stage": st}}
        for sd in ("bf16", "int8")
        for st in (0, 1, 2, 3)
    ),
    {
        **INT8,
        "precision": {**BF16_MASTERS["precision"], "master_update": "kahan"},
        "zero": {"stage": 2},
    },
    {
        **INT8,
        "precision": {**BF16_MASTERS["precision"], "master_update": "stochastic"},
        "zero": {"stage": 3},
    },
    {**INT8, "zero": {"stage": 2, "offload_optimizer": "cpu"}},
]


@functools.cache
def _rank_results(world: int) -> list:
    if world == 1:
        return [run_many(RANK_CASES, STEPS)]
    return run_ranks(run_many, world, RANK_CASES, STEPS)


def _params_bytes(res: dict, state: int) -> int:
    """int8 optimizer bytes of a run by the formula: per state, 1 byte per element and
    a 4-byte scale per started block of each parameter (each starts a block)."""
    numels = [v.numel() for v in res["params"].values()]
    return state * sum(n + 4 * -(-n // 256) for n in numels)


@pytest.mark.parametrize("i", range(len(RANK_CASES)))
def test_two_ranks_equal_one_at_every_stage(i: int) -> None:
    case, one = RANK_CASES[i], _rank_results(1)[0][i]
    two = [r[i] for r in _rank_results(2)]
    err = rel_err(two[0]["params"], one["params"])
    bf16_weights = "precision" in case
    # bf16 compute: each rank's weight gradient is a bf16 GEMM over its own rows, so
    # 2 ranks round differently from 1 (tests/test_zero.py: BF16_PARAM_TOL); in fp32 the
    # int8 blocks are the same at any world size and stage, and so are the numbers
    assert err < (2e-2 if bf16_weights else 1e-4), f"{case}: {err:.2e}"
    assert all(torch.equal(two[0]["params"][k], two[1]["params"][k]) for k in one["params"])
    if (
        case["optimizer"]["state_dtype"] == "int8"
        and case["zero"]["stage"] == 0
        and not bf16_weights
    ):
        # measured = formula: 2 states of (1 + 4/256 per block) bytes per element
        assert one["memory"]["device"]["optimizer"] == _params_bytes(one, 2)


# ----------------------------------------------------------------------------- checkpoints

KAHAN_INT8 = {**INT8, "precision": {**BF16_MASTERS["precision"], "master_update": "kahan"}}


def _engine(
    over: dict, steps: int, start: int = 0, load: Path | None = None, save: Path | None = None
) -> Engine:
    cfg = make_config(over, 1, 10)
    torch.manual_seed(0)
    eng = Engine(GPT(cfg.model), cfg, torch.device("cpu"))
    if load is not None:
        eng.load_checkpoint(load)
    b = cfg.data.micro_batch_size
    for i, (X, Y) in enumerate(batches(start + steps)):
        if i >= start:
            eng.backward(eng(*local_batch(X, Y, 0, 1, b)))
            eng.step()
    if save is not None:
        eng.save_checkpoint(save)
    return eng


def test_resume_is_bit_exact_and_reshards_states_exactly(tmp_path: Path) -> None:
    z2 = {**KAHAN_INT8, "zero": {"stage": 2}}
    whole = full_params(_engine(z2, 4))
    _engine(z2, 2, save=tmp_path / "a")
    resumed = _engine(z2, 2, start=2, load=tmp_path / "a")
    assert all(torch.equal(whole[k], v) for k, v in full_params(resumed).items())
    # ZeRO-2 → ZeRO-3 (other units, other cut): every saved state, codes and scales
    # included, comes back bit for bit (saved again at once and compared)
    _engine({**z2, "zero": {"stage": 3}}, 0, load=tmp_path / "a", save=tmp_path / "b")
    a, b = (SavedShards(resolve(tmp_path / k), read_meta(resolve(tmp_path / k))) for k in "ab")
    names = a.state_names(list(whole))
    assert {"exp_avg~q8", "exp_avg~scale", "exp_avg_sq~q8", "master_comp"} <= set(names)
    for p, v in whole.items():
        for kind in names:
            if kind == "step":
                continue
            n = -(-v.numel() // 256) if kind.endswith("~scale") else v.numel()
            assert torch.equal(a.read(kind, p, 0, n), b.read(kind, p, 0, n)), (p, kind)


def test_converting_state_dtypes_says_what_it_did(tmp_path: Path) -> None:
    _engine(INT8, 2, save=tmp_path / "a")
    eng = _engine({"optimizer": {"state_dtype": "fp32"}}, 0, load=tmp_path / "a")
    assert eng.last_load.notes == [
        "[zerotrain] optimizer states converted int8 → fp32: "
        "dequantised, exactly the values the int8 states held"
    ]
    st = next(iter(eng.optimizer.state.values()))
    assert st["exp_avg"].dtype == torch.float32 and "exp_avg~q8" not in st
    eng = _engine({"optimizer": {"state_dtype": "bf16"}}, 0, load=tmp_path / "a")
    assert "int8 → bf16" in eng.last_load.notes[0]
    back = _engine(INT8, 0, load=tmp_path / "a")  # the same form: nothing converted
    assert back.last_load.notes == [] and back.optimizer.conversions == ()


# ----------------------------------------------------------------------------- bad input


def test_bad_settings_are_one_clear_error() -> None:
    with pytest.raises(ValueError, match="state_dtype"):
        build_config({"optimizer": {"state_dtype": "int4"}})
    with pytest.raises(
        ValueError,
        match=r"master_dtype bf16 needs precision\.dtype bf16, "
        r"not fp16: fp16 compute keeps fp32 masters",
    ):
        build_config({"precision": {"dtype": "fp16", "master_dtype": "bf16"}})
    with pytest.raises(ValueError, match="implemented for adamw, adam, lion, sgd and muon"):
        build_config({"optimizer": {"name": "adagrad", "state_dtype": "bf16"}})
    with pytest.raises(ValueError, match="master_update applies to bf16 masters only"):
        build_config({"precision": {"dtype": "bf16", "master_update": "kahan"}})
    cfg = build_config({"optimizer": {"name": "sgd", "state_dtype": "int8"}})
    assert "nothing to store" in cfg.optimizer.state_note()  # a note; the run goes on
    pure = build_config({"precision": {"dtype": "bf16-pure"}}).precision
    assert (pure.bf16_masters, pure.update_rule) == (True, "plain")  # a named point


def test_plain_sgd_with_int8_runs() -> None:
    eng = _engine({"optimizer": {"name": "sgd", "state_dtype": "int8", "lr": 0.1}}, 2)
    assert all(not st for st in eng.optimizer.state.values())  # no state at all


# ----------------------------------------------------------------------------- estimator


def test_estimate_counts_compact_bytes(capsys: pytest.CaptureFixture) -> None:
    from zerotrain.cli.estimate import main_estimate

    def run(*flags: str) -> dict:
        assert (
            main_estimate(
                [
                    "--params",
                    "1B",
                    "--gpus",
                    "4",
                    "--gpu-mem",
                    "8GB",
                    "--max-params",
                    "--stage",
                    "3",
                    "--json",
                    *flags,
                ]
            )
            == 0
        )
        return json.loads(capsys.readouterr().out)

    fp32 = run()
    small = run("--state-dtype", "int8", "--master-dtype", "bf16")
    assert small["bytes_per_param"] == {
        "params": 2,
        "grads": 2,
        "master": 0,
        "optimizer": 2 + 8 / 256,
        "comp": 2,
    }
    row = small["rows"][0]
    assert row["device"]["optimizer"] == math.ceil(1e9 / 4 * (2 + 8 / 256))
    assert row["device"]["master"] == 1e9 / 4 * 2  # the compensation
    # 16 → 8.03 bytes/param: about twice the parameters in the same memory
    ratio = row["max_params"] / fp32["rows"][0]["max_params"]
    assert 1.95 < ratio < 2.0
    labels = {r["label"]: r["bytes_per_param"] for r in small["compact_rows"]}
    assert labels["int8 states, bf16 master + stochastic"] == 6 + 8 / 256


def test_deepspeed_low_precision_keys_map_to_compact_states() -> None:
    from zerotrain.deepspeed_config import from_deepspeed

    cfg = build_config(
        from_deepspeed(
            {
                "train_micro_batch_size_per_gpu": 2,
                "bf16": {
                    "enabled": True,
                    "bf16_master_weights_and_grads": True,
                    "bf16_optimizer_states": True,
                },
            },
            world_size=1,
        )
    )
    assert cfg.optimizer.state_dtype == "bf16"
    assert (cfg.precision.master_dtype, cfg.precision.master_update) == ("bf16", "plain")
    assert cfg.precision.grad_accum_dtype == "compute"
    with pytest.raises(ValueError, match=r"needs bf16\.enabled true"):
        from_deepspeed(
            {
                "train_micro_batch_size_per_gpu": 2,
                "bf16": {"enabled": False, "bf16_optimizer_states": True},
            },
            world_size=1,
        )


def test_nvme_tier_resumes_int8_and_kahan_bit_exact(tmp_path: Path) -> None:
    """The NVMe tier streams codes, scales and compensation; a resume reads them back
    in their own dtypes (not cast to the masters')."""
    tier = {
        "stage": 3,
        "offload_optimizer": "nvme",
        "offload_param": "nvme",
        "nvme_path": str(tmp_path / "nvme"),
        "nvme_block_mb": 0.0625,
    }
    over = {**KAHAN_INT8, "zero": tier}

    def run(steps: int, **kw: Any) -> dict:
        eng = _engine(over, steps, **kw)
        out = full_params(eng)
        eng.close()
        return out

    whole = run(4)
    run(2, save=tmp_path / "ck")
    resumed = run(2, start=2, load=tmp_path / "ck")
    assert all(torch.equal(whole[k], v) for k, v in resumed.items())
