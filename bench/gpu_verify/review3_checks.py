"""The fourth GPU review's one-GPU checks (its appendix A, ../shared/findings/
gpu-review-3.md; bench/gpu_check.sh's `review3` section): the code added since the kit
was written — activation offload (W-2, W-3), the FP8 wire (W-1, and 30+ steps of it
against plain FP8), FP8 gather + a parameter tier (C-2), the ZeRO-Infinity tiers, tiles
and the document mask at T = 8192, the DeepSpeed drop-in — on one GPU.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src:tests \
        python bench/gpu_verify/review3_checks.py --out DIR \
        [--only alloc_race stash fp8wire fp8long fp8tier tiers longseq ds]
    ... --dry-run        # CPU, tiny sizes: tests this script only (no stream can race)

Each check prints and records one or more rows {check, status, detail} in DIR/review3.json;
status PASS / FAIL / REPRODUCED (the review's predicted defect happened) / FIXED / INFO /
SKIP. A check that raises is a FAIL row; the others still run. Defects other changes may
fix are judged from behaviour: REPRODUCED or FIXED, whichever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch

ROWS: list[dict] = []
DRY = False


def row(check: str, status: str, detail: str = "") -> None:
    ROWS.append({"check": check, "status": status, "detail": detail})
    print(f"[review3] {status:10} {check}: {detail}", flush=True)


def dev() -> torch.device:
    return torch.device("cpu" if DRY else "cuda")


def sleep_ms(ms: float) -> None:
    if not DRY:
        torch.cuda._sleep(int(ms * 2e6))  # ~2 GHz clocks


# ------------------------------------------------------------------ W-2 mechanism
def c_alloc_race() -> None:
    """Allocate on the compute stream, write on a side stream that did not wait for it:
    the block of a tensor freed in host order is overwritten before its last reader ran."""
    if DRY:
        return row("alloc race (HostStash.fetch's pattern)", "SKIP", "needs CUDA streams")
    side, n = torch.cuda.Stream(), 1 << 24
    src = torch.full((n,), 7.0, pin_memory=True)  # pinned first: cudaHostAlloc may sync
    a = torch.ones(n, device="cuda")
    ptr = a.data_ptr()
    sleep_ms(50)  # the compute stream lags the host by ~50 ms
    b = a * 2  # a's last reader, queued behind the sleep
    del a  # a's block is free for the compute stream
    d = torch.empty(n, device="cuda")  # ... and handed out again at once
    with torch.cuda.stream(side):  # no side.wait_stream(current): as HostStash.fetch
        d.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    bad = int((b != 2).sum())
    row(
        "alloc race (HostStash.fetch's pattern)",
        "REPRODUCED" if bad else "INFO",
        f"block reused {d.data_ptr() == ptr}; {bad} of {n} elements of b corrupted",
    )


# ------------------------------------------------------------------ W-2 / W-3 in situ
def _ckpt_grads(mode, dropout: float, lag: bool) -> dict:
    from zerotrain.config import ModelConfig
    from zerotrain.models import checkpointing as C
    from zerotrain.models.gpt import GPT

    L, C_, T, B = (2, 32, 16, 2) if DRY else (6, 1024, 2048, 2)
    torch.manual_seed(0)
    m = GPT(
        ModelConfig(
            arch="gpt",
            n_layer=L,
            n_head=8 if not DRY else 2,
            n_embd=C_,
            block_size=T,
            dropout=dropout,
            bias=False,
        )
    ).to(dev())
    C.apply_checkpointing(m.blocks, mode, force_stash=DRY and mode == "offload")
    real = C.HostStash.get
    if lag:

        def get(self):
            if self.first is None:  # the recompute: make the compute stream lag
                sleep_ms(25)
            return real(self)

        C.HostStash.get = get
    try:
        g = torch.Generator().manual_seed(1)
        x, y = (torch.randint(0, 256, (B, T), generator=g).to(dev()) for _ in range(2))
        torch.manual_seed(2)
        if not DRY:
            torch.cuda.manual_seed(2)
        m(x, y).backward()
        if not DRY:
            torch.cuda.synchronize()
        return {n: p.grad.detach().float().cpu() for n, p in m.named_parameters()}
    finally:
        C.HostStash.get = real


def c_stash() -> None:
    if not DRY:
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    for dropout, what in (
        (0.0, "W-2 offload checkpointing under a lagging stream"),
        (0.1, "W-3 offload checkpointing with dropout (CUDA RNG)"),
    ):
        ref = _ckpt_grads(True, dropout, False)
        got = _ckpt_grads("offload", dropout, dropout == 0.0)
        diff = max(float((got[k] - ref[k]).abs().max()) for k in ref)
        row(
            what,
            "PASS" if diff == 0 else ("FAIL" if DRY else "REPRODUCED"),
            f"max |grad(offload) - grad(true)| = {diff:.3g} (bitwise expected)",
        )


# ------------------------------------------------------------------ ZeRO-Infinity
def _train(over: dict, steps: int, sleep_copies: bool = False) -> dict:
    from zerotrain.config import build_config, deep_merge
    from zerotrain.data.sampler import to_device
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT
    from zerotrain.zero.tiers import tier as T

    L, C_ = (2, 32) if DRY else (4, 512)
    base = {
        "model": {
            "n_layer": L,
            "n_head": 2 if DRY else 8,
            "n_embd": C_,
            "block_size": 64,
            "bias": False,
        },
        "precision": {"dtype": "bf16"},
        "zero": {"stage": 3},
        "optimizer": {"lr": 1e-3},
        "schedule": {"warmup_steps": 0, "kind": "constant"},
        "data": {"micro_batch_size": 4},
        "train": {"steps": steps, "device": dev().type},
    }
    cfg = build_config(deep_merge(base, over))
    real = T.HostTier._copy
    if sleep_copies:  # every tier copy lands ~10 ms late: a missing fence shows

        def _copy(self, *a, **k):
            with torch.cuda.stream(self.stream):
                sleep_ms(10)
            return real(self, *a, **k)

        T.HostTier._copy = _copy
    try:
        torch.manual_seed(0)
        eng = Engine(GPT(cfg.model), cfg)
        g = torch.Generator().manual_seed(3)
        t0, moved = time.perf_counter(), []
        for _ in range(steps):
            x, y = (torch.randint(0, 256, (4, 64), generator=g) for _ in range(2))
            eng.backward(eng(to_device(x, eng.device), to_device(y, eng.device)))
            eng.step()
            moved.append(eng.last_tier_bytes)
        if not DRY:
            torch.cuda.synchronize()
        secs = (time.perf_counter() - t0) / steps
        with eng.full_parameters():
            params = {n: p.detach().float().cpu() for n, p in eng.module.named_parameters()}
        lines = eng.strategy.describe()
        peak = torch.cuda.max_memory_allocated() / 2**20 if not DRY else 0
        eng.close()
        return {
            "params": params,
            "s": secs,
            "moved": moved[-1],
            "describe": lines,
            "peak_mib": peak,
        }
    finally:
        T.HostTier._copy = real


def c_tiers(work: Path) -> None:
    nv = str(work / "nvme")
    steps = 3 if DRY else 6
    plain = _train({}, steps)
    cpu_opt = _train({"zero": {"offload_optimizer": "cpu"}}, steps)
    cases = [
        ("offload_param cpu", {"zero": {"offload_param": "cpu"}}, plain, False),
        ("offload_param cpu, late copies", {"zero": {"offload_param": "cpu"}}, plain, not DRY),
        ("offload_param nvme", {"zero": {"offload_param": "nvme", "nvme_path": nv}}, plain, False),
        (
            "offload_optimizer nvme",
            {"zero": {"offload_optimizer": "nvme", "nvme_path": nv}},
            cpu_opt,
            False,
        ),
        (
            "both nvme",
            {"zero": {"offload_param": "nvme", "offload_optimizer": "nvme", "nvme_path": nv}},
            cpu_opt,
            False,
        ),
    ]
    for name, over, ref, late in cases:
        r = _train(over, steps, late)
        diff = max(float((r["params"][k] - ref["params"][k]).abs().max()) for k in ref["params"])
        row(
            f"tiers: {name} vs {'plain' if ref is plain else 'offload_optimizer cpu'}",
            "PASS" if diff == 0 else "FAIL",
            f"max |param diff| {diff:.3g}; {r['s'] * 1e3:.0f} ms/step (ref "
            f"{ref['s'] * 1e3:.0f}); tier bytes {r['moved']}; peak {r['peak_mib']:.0f} MiB; "
            + " | ".join(r["describe"])[:200],
        )


# ------------------------------------------------------------------ long sequences
def c_longseq() -> None:
    from zerotrain.config import build_config, deep_merge
    from zerotrain.engine import Engine
    from zerotrain.models import build_model

    T = 64 if DRY else 8192
    base = {
        "model": {
            "arch": "llama",
            "n_layer": 2,
            "n_head": 2 if DRY else 8,
            "n_embd": 32 if DRY else 1024,
            "block_size": T,
            "vocab_size": 512 if DRY else 32000,
        },
        "precision": {"dtype": "bf16"},
        "zero": {"stage": 3},
        "optimizer": {"lr": 1e-4},
        "data": {"micro_batch_size": 1},
        "train": {"steps": 2, "device": dev().type},
    }
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1, base["model"]["vocab_size"], (1, T), generator=g)
    x[0, :: max(T // 8, 2)] = 0  # eight documents, EOS = 0
    y = torch.roll(x, -1, 1)

    def run(over: dict, backend=None) -> dict:
        cfg = build_config(deep_merge(base, over))
        torch.manual_seed(0)
        eng = Engine(build_model(cfg.model, device="meta"), cfg)
        if not DRY:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        ctx = (
            torch.nn.attention.sdpa_kernel(backend)
            if backend is not None
            else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        )
        with ctx:
            loss = eng(x.to(eng.device), y.to(eng.device))
            eng.backward(loss)
        if not DRY:
            torch.cuda.synchronize()
        out = {
            "loss": float(loss.detach()),
            "s": time.perf_counter() - t0,
            "peak": torch.cuda.max_memory_allocated() / 2**30 if not DRY else 0.0,
            "reserved": torch.cuda.max_memory_reserved() / 2**30 if not DRY else 0.0,
            "norm": eng.step().grad_norm,
        }
        eng.close()
        return out

    plain = run({})
    tiled = run({"sequence": {"tile_tokens": T // 8}})
    row(
        "tiles: loss and grad norm vs plain (bf16)",
        "PASS"
        if abs(tiled["loss"] - plain["loss"]) < 2e-2 * abs(plain["loss"])
        and abs(tiled["norm"] - plain["norm"]) < 5e-2 * plain["norm"]
        else "FAIL",
        f"loss {plain['loss']:.4f} -> {tiled['loss']:.4f}, norm {plain['norm']:.4g} -> "
        f"{tiled['norm']:.4g}; peak {plain['peak']:.2f} -> {tiled['peak']:.2f} GiB "
        f"(reserved {plain['reserved']:.2f} -> {tiled['reserved']:.2f}: fragmentation)",
    )
    docs = {"data": {"document_mask": True, "eos_token_id": 0}}
    try:
        from torch.nn.attention import SDPBackend

        forced = None if DRY else [SDPBackend.EFFICIENT_ATTENTION]
        masked = run(docs, forced)
        row(
            "document mask: SDPA memory-efficient kernel takes the [B,1,T,T] mask",
            "PASS" if not DRY else "INFO",
            f"T={T}: {masked['s']:.2f} s fwd+bwd vs {plain['s']:.2f} s causal; peak "
            f"{masked['peak']:.2f} vs {plain['peak']:.2f} GiB",
        )
    except RuntimeError as e:
        row(
            "document mask: SDPA memory-efficient kernel takes the [B,1,T,T] mask",
            "FAIL",
            f"no efficient kernel for the mask (math fallback: O(H*T^2) memory): {e}"[:300],
        )


# ------------------------------------------------------------------ FP8 wire
def c_fp8wire() -> None:
    from torch import nn

    from zerotrain.numerics.formats import FP8_E4M3
    from zerotrain.numerics.fp8 import scale_from_amax
    from zerotrain.zero.flat import FlatUnit
    from zerotrain.zero.params.fp8_wire import Fp8Wire
    from zerotrain.zero.partition import Partition

    a, b = nn.Parameter(torch.randn(64, 64)), nn.Parameter(torch.randn(64, 64))
    u = FlatUnit.build(0, "blk", [("q.weight", a, 0), ("o.weight", b, 0)], Partition(2, 0), 8)
    u.wire = Fp8Wire(u, {"q.weight", "o.weight"}, 2)
    u.shard = torch.randn(u.shard_numel).bfloat16().to(dev())
    one, eight = torch.tensor(1.0), torch.tensor(8.0)
    u.wire.pack(u.shard, {"q.weight": one, "o.weight": one})
    u.wire.pack(u.shard, {"q.weight": one, "o.weight": eight})  # o's amax grew on rank 1
    have = float(u.wire.scales["o.weight"])
    want = float(scale_from_amax(eight, FP8_E4M3))
    row(
        "W-1 FP8 gather: scale of a weight held only by the other rank after an update",
        "REPRODUCED" if have != want else "FIXED",
        f"rank 0 dequantises with {have:g}, rank 1 encoded with {want:g}",
    )
    if DRY:
        return
    from zerotrain.numerics.fp8_gather import dequantize

    n = 1 << 28  # a 268M-element gathered unit (about one 7B block)
    q = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda") & 0x7E
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    s = torch.tensor(64.0, device="cuda")
    for name, fn in (
        ("table (shipped)", lambda: dequantize(q, s, torch.bfloat16, out=out)),
        (
            "native cast",
            lambda: out.copy_(q.view(torch.float8_e4m3fn).to(torch.bfloat16).mul_(1 / 64.0)),
        ),
    ):
        fn()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        row(
            f"FP8 gather unpack, {name}",
            "INFO",
            f"{(time.perf_counter() - t) * 1e3:.1f} ms, transient "
            f"{(torch.cuda.max_memory_allocated() - base) / 2**30:.2f} GiB for {n:,} elements",
        )


def c_fp8long() -> None:
    """The FP8 wire over 32 steps at full learning rate (no warmup to hide a drift):
    ZeRO-3 bf16 tensorwise FP8 with and without precision.fp8.all_gather, bit for bit.
    One GPU holds every piece, so this is the CUDA encode/decode path over many refreshes;
    W-1 itself (a weight held by the other rank) is the unit row above."""
    steps = 4 if DRY else 32
    fp8 = {"enabled": True, "recipe": "tensorwise"}
    plain = _train({"precision": {"dtype": "bf16", "fp8": fp8}}, steps)
    wired = _train({"precision": {"dtype": "bf16", "fp8": {**fp8, "all_gather": True}}}, steps)
    diff = max(
        float((wired["params"][k] - plain["params"][k]).abs().max()) for k in plain["params"]
    )
    row(
        f"FP8 wire over {steps} steps: all_gather vs plain FP8 (ZeRO-3, world 1)",
        "PASS" if diff == 0 else "FAIL",
        f"max |param diff| {diff:.3g} (bitwise expected); {wired['s'] * 1e3:.0f} vs "
        f"{plain['s'] * 1e3:.0f} ms/step; peak {wired['peak_mib']:.0f} vs "
        f"{plain['peak_mib']:.0f} MiB",
    )


# ------------------------------------------------------------------ FP8 gather + tier
def c_fp8tier(work: Path) -> None:
    """precision.fp8.all_gather with zero.offload_param: the wire packs every unit's bytes
    from `u.shard` after the tier released it (ZeRO3.__init__ -> after_publish)."""
    from zerotrain.config import ConfigError, build_config
    from zerotrain.engine import Engine
    from zerotrain.models.gpt import GPT

    kind = "nvme" if DRY else "cpu"  # on a CPU the host tier is logical (never releases)
    what = f"C-2 FP8 all-gather + offload_param {kind}"
    try:
        cfg = build_config(
            {
                "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32, "bias": False},
                "precision": {"dtype": "bf16", "fp8": {"enabled": True, "all_gather": True}},
                "zero": {"stage": 3, "offload_param": kind, "nvme_path": str(work / "nvme8")},
                "train": {"device": dev().type},
            }
        )
    except (ConfigError, ValueError) as e:  # refused before start: the fix chosen first
        return row(what, "FIXED", f"refused at config time: {str(e).splitlines()[0][:200]}")
    torch.manual_seed(0)
    try:
        eng = Engine(GPT(cfg.model), cfg)
        x = torch.randint(0, 256, (2, 32), device=eng.device)
        eng.backward(eng(x, x))
        eng.step()
        eng.close()
        row(what, "FIXED", "built and stepped")
    except RuntimeError as e:
        row(what, "REPRODUCED", f"{str(e).splitlines()[0][:200]}")


# ------------------------------------------------------------------ DeepSpeed drop-in
def c_ds(work: Path) -> None:
    from torch import nn

    import zerotrain.deepspeed as deepspeed

    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    eng, _opt, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    # a bf16 engine takes bf16 inputs, as DeepSpeed's does
    x = torch.randn(4, 256, device=eng.device, dtype=torch.bfloat16)
    losses = []
    for _ in range(3):
        loss = eng(x).float().pow(2).mean()
        eng.backward(loss)
        eng.step()
        losses.append(float(loss))
    eng.save_checkpoint(str(work / "ds"))
    with deepspeed.zero.GatheredParameters(list(net.parameters())):
        w = net[0].weight.detach().float().cpu().clone()
    row(
        "DeepSpeed drop-in: stage 3 bf16 on the GPU, 3 steps, save, GatheredParameters",
        "PASS" if losses[-1] < losses[0] and torch.isfinite(w).all() else "FAIL",
        f"losses {[round(v, 4) for v in losses]}; device {eng.device}",
    )


def main() -> None:
    global DRY
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--only", nargs="*")
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args()
    DRY = a.dry_run
    out = Path(a.out)
    work = out / "review3_work"
    work.mkdir(parents=True, exist_ok=True)
    checks = {
        "alloc_race": c_alloc_race,
        "stash": c_stash,
        "fp8wire": c_fp8wire,
        "fp8long": c_fp8long,
        "fp8tier": lambda: c_fp8tier(work),
        "tiers": lambda: c_tiers(work),
        "longseq": c_longseq,
        "ds": lambda: c_ds(work),
    }
    for name, fn in checks.items():
        if a.only and name not in a.only:
            continue
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:
            row(f"{name}: raised", "FAIL", f"{type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
        print(f"[review3] {name}: {time.perf_counter() - t:.1f} s", flush=True)
    (out / "review3.json").write_text(json.dumps(ROWS, indent=1))


if __name__ == "__main__":
    main()
