"""Optimizers: ours vs torch.optim, vs paper formulas, and behaviour the math promises.

Equivalence criterion ("≤1e-6 relative"): for every tensor, max|ours − ref| ≤
1e-6 · max(1, max|ref|) after the whole run.
"""

from __future__ import annotations

import io
import itertools
import math
import shutil

import pytest
import torch

from zerotrain.config import OptimizerConfig
from zerotrain.optim import (
    OPTIMIZERS,
    SGD,
    Adagrad,
    Adam,
    AdamW,
    Lion,
    Muon,
    RMSprop,
    batching,
    build_optimizer,
    functional,
    muon,
    state_bytes_per_param,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine some
    ops (sqrt) stall waiting for the second OpenMP thread to be scheduled."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


RTOL = 1e-6
SHAPES = [(37, 29), (300,), (16, 16), (5,), (2, 3, 4), (700,)]
FLAT = [70_001, 5_003, 1_001]  # "ZeRO" segments; BLOCK_ELEMENTS is shrunk so they split


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL) -> None:
    err = (ours - ref).abs().max().item()
    bound = rtol * max(1.0, ref.abs().max().item())
    assert err <= bound, f"max abs diff {err:.3g} > {bound:.3g}"


class Problem:
    """Fixed random quadratic-plus-noise: g = c ⊙ (θ − t) + noise_k (same for both runs)."""

    def __init__(self, shapes, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.shapes = shapes
        self.init = [torch.randn(s, generator=gen) for s in shapes]
        self.c = [torch.rand(s, generator=gen) * 2 for s in shapes]
        self.t = [torch.randn(s, generator=gen) for s in shapes]
        self.seed = seed

    def params(self) -> list[torch.Tensor]:
        return [x.clone() for x in self.init]

    def set_grads(self, params, k: int) -> None:
        gen = torch.Generator().manual_seed(self.seed * 1000 + k)
        for p, c, t in zip(params, self.c, self.t):
            p.grad = c * (p.detach() - t) + 0.1 * torch.randn(p.shape, generator=gen)


def groups(params, lr: float, wd: float) -> list[dict]:
    """Three groups with different lr and weight decay."""
    thirds = [params[0::3], params[1::3], params[2::3]]
    return [
        {"params": thirds[0], "lr": lr, "weight_decay": wd},
        {"params": thirds[1], "lr": lr * 0.5, "weight_decay": 0.0},
        {"params": thirds[2], "lr": lr * 2.0, "weight_decay": wd * 3},
    ]


CASES = {
    "sgd": (SGD, torch.optim.SGD, dict(lr=0.05), 0.01),
    "sgd_momentum": (SGD, torch.optim.SGD, dict(lr=0.02, momentum=0.9), 0.01),
    "sgd_dampening": (SGD, torch.optim.SGD, dict(lr=0.02, momentum=0.9, dampening=0.3), 0.01),
    "sgd_nesterov": (SGD, torch.optim.SGD, dict(lr=0.02, momentum=0.8, nesterov=True), 0.01),
    "adagrad": (Adagrad, torch.optim.Adagrad,
                dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1, eps=1e-6), 0.01),
    "rmsprop": (RMSprop, torch.optim.RMSprop, dict(lr=0.003, alpha=0.9), 0.01),
    "rmsprop_momentum": (RMSprop, torch.optim.RMSprop, dict(lr=0.003, momentum=0.9), 0.01),
    "rmsprop_centered": (RMSprop, torch.optim.RMSprop,
                         dict(lr=0.003, momentum=0.5, centered=True), 0.01),
    "adam": (Adam, torch.optim.Adam, dict(lr=0.01, betas=(0.9, 0.99)), 0.05),
    "adamw": (AdamW, torch.optim.AdamW, dict(lr=0.01, betas=(0.9, 0.95), eps=1e-6), 0.1),
}


def train(opt, problem, params, steps: int, start: int = 0, lr_wave: bool = True) -> None:
    """`steps` updates; the lr of every group is rescaled each step, as a schedule does."""
    base = [g.setdefault("base_lr", g["lr"]) for g in opt.param_groups]
    for k in range(start, start + steps):
        if lr_wave:
            for g, b in zip(opt.param_groups, base):
                g["lr"] = b * (0.5 + 0.5 * math.cos(k / 17))
        problem.set_grads(params, k)
        opt.step()


def compare(ours_opt, ref_opt, ours_params, ref_params) -> None:
    for a, b in zip(ours_params, ref_params):
        assert_close(a, b)
    for a, b in zip(ours_params, ref_params):
        sa, sb = ours_opt.state[a], ref_opt.state[b]
        assert set(sa) == set(sb)
        for key in sb:
            assert_close(sa[key], sb[key])


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("layout", ["model", "flat"])
def test_matches_torch(case, layout, monkeypatch):
    ours_cls, ref_cls, hyper, wd = CASES[case]
    if layout == "flat":
        monkeypatch.setattr(batching, "BLOCK_ELEMENTS", 4096)  # exercise the splitting
    problem = Problem(SHAPES if layout == "model" else [(n,) for n in FLAT])
    ours_p, ref_p = problem.params(), problem.params()
    ours = ours_cls(groups(ours_p, hyper["lr"], wd), **hyper)
    ref = ref_cls(groups(ref_p, hyper["lr"], wd), **hyper)
    train(ours, problem, ours_p, 200)
    train(ref, problem, ref_p, 200)
    compare(ours, ref, ours_p, ref_p)


@pytest.mark.parametrize("case", ["sgd_dampening", "adagrad", "rmsprop_centered", "adam", "adamw"])
@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_state_dict_round_trip(case, direction):
    ours_cls, ref_cls, hyper, wd = CASES[case]
    src_cls, dst_cls = (ref_cls, ours_cls) if direction == "torch_to_ours" else (ours_cls, ref_cls)
    problem = Problem(SHAPES, seed=1)
    # the uninterrupted reference run: torch for 80 steps
    ref_p = problem.params()
    ref = ref_cls(groups(ref_p, hyper["lr"], wd), **hyper)
    train(ref, problem, ref_p, 80)
    # interrupted: src for 40 steps, checkpoint through bytes, dst resumes for 40
    src_p = problem.params()
    src = src_cls(groups(src_p, hyper["lr"], wd), **hyper)
    train(src, problem, src_p, 40)
    buf = io.BytesIO()
    torch.save({"params": src_p, "optim": src.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    dst_p = [p.clone() for p in ckpt["params"]]
    dst = dst_cls(groups(dst_p, 123.0, 0.0), **{**hyper, "lr": 123.0})  # wrong on purpose
    dst.load_state_dict(ckpt["optim"])
    for g in dst.param_groups:
        assert g["lr"] != 123.0 and "base_lr" in g
    train(dst, problem, dst_p, 40, start=40)
    compare(dst, ref, dst_p, ref_p)


@pytest.mark.parametrize("case", ["sgd_momentum", "adagrad", "rmsprop_centered", "adamw"])
def test_state_dict_layout_matches_torch(case):
    ours_cls, ref_cls, hyper, wd = CASES[case]
    problem = Problem(SHAPES[:2])
    sds = []
    for cls in (ours_cls, ref_cls):
        params = problem.params()
        opt = cls(groups(params, hyper["lr"], wd), **hyper)
        train(opt, problem, params, 2)
        sds.append(opt.state_dict())
    ours, ref = sds
    assert ours["state"].keys() == ref["state"].keys()
    for i, st in ref["state"].items():
        assert ours["state"][i].keys() == st.keys()
        if "step" in st:
            assert ours["state"][i]["step"].dtype == torch.float32
            assert ours["state"][i]["step"].shape == () and float(st["step"]) == 2.0


def test_torch_only_flags_are_refused():
    p = torch.zeros(3)
    p.grad = torch.ones(3)
    ref = torch.optim.Adam([p.clone()], amsgrad=True)
    ours = Adam([p])
    ours.load_state_dict(ref.state_dict())
    with pytest.raises(ValueError, match="amsgrad"):
        ours.step()


# ----------------------------------------------------------------------------- large flat tensors


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum"])
def test_default_blocking_on_a_large_flat_tensor(name):
    """One tensor larger than the real BLOCK_ELEMENTS, as a ZeRO segment would be."""
    ours_cls, ref_cls, hyper, wd = CASES[name]
    problem = Problem([(batching.BLOCK_ELEMENTS * 2 + 12_345,), (999,)], seed=3)
    ours_p, ref_p = problem.params(), problem.params()
    ours = ours_cls([{"params": ours_p, "weight_decay": wd}], **hyper)
    ref = ref_cls([{"params": ref_p, "weight_decay": wd}], **hyper)
    train(ours, problem, ours_p, 10)
    train(ref, problem, ref_p, 10)
    compare(ours, ref, ours_p, ref_p)


def test_blocking_is_bit_exact(monkeypatch):
    """Elementwise rules do not care how the tensors are cut: blocks change nothing."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(10_000,), (33,), (64, 70), (7,)]
    p0 = [torch.randn(s, generator=gen) for s in shapes]
    g = [torch.randn(s, generator=gen) for s in shapes]
    results = []
    for block in (1 << 30, 1000, 37):
        monkeypatch.setattr(batching, "BLOCK_ELEMENTS", block)
        p = [x.clone() for x in p0]
        m = [torch.zeros_like(x) for x in p0]
        v = [torch.zeros_like(x) for x in p0]
        for step in (1, 2, 3):
            functional.adamw_(p, g, m, v, step=step, lr=1e-2, weight_decay=0.1)
        results.append(torch.cat([x.flatten() for x in p + m + v]))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_single_tensor_and_list_calls_agree():
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(500, generator=gen)
    g = torch.randn(500, generator=gen)
    a, b = p.clone(), [p[:200].clone(), p[200:].clone()]
    ma, va = torch.zeros(500), torch.zeros(500)
    mb, vb = [torch.zeros(200), torch.zeros(300)], [torch.zeros(200), torch.zeros(300)]
    functional.adam_(a, g, ma, va, step=1, lr=0.1, weight_decay=0.2)
    functional.adam_(b, [g[:200], g[200:]], mb, vb, step=1, lr=0.1, weight_decay=0.2)
    assert torch.equal(a, torch.cat(b)) and torch.equal(va, torch.cat(vb))


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")),
                    reason="torch.compile on CPU needs a C++ compiler")
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch-internal, at inductor import
def test_compiled_adamw_matches_eager_without_recompiling():
    """The compiled path runs the same _adam_math; a new lr each step must not recompile."""
    from torch._dynamo.utils import counters

    gen = torch.Generator().manual_seed(0)
    sizes = [functional.COMPILE_MIN_ELEMENTS + 5, 2 * functional.COMPILE_MIN_ELEMENTS, 100]
    p0 = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(6)]
    runs = []
    for compiled in (False, True):
        params = [x.clone() for x in p0]
        opt = AdamW([{"params": params[:2], "weight_decay": 0.1},
                     {"params": params[2:], "weight_decay": 0.0}], lr=1e-2, compiled=compiled)
        graphs = counters["stats"]["unique_graphs"]
        for k, gs in enumerate(grads):
            for group in opt.param_groups:
                group["lr"] = 1e-2 * (k + 1) / 6 if k else 0.0  # includes a zero-lr step
            for p, g in zip(params, gs):
                p.grad = g
            opt.step()
        runs.append(params)
    assert not batching.compile_broken()
    assert counters["stats"]["unique_graphs"] - graphs <= 3  # (update, no-update, shape)
    for a, b in zip(*runs):
        assert_close(a, b)


def test_compile_auto_only_for_large_shards():
    """`optimizer.compile: auto` compiles where the one-off cost pays (≥ 2^24 params per
    rank) and nowhere else; explicit true/false win. Meta tensors: nothing is allocated."""
    from zerotrain.config import build_config
    from zerotrain.optim import COMPILE_AUTO_MIN_PARAMS, build_optimizer, resolve_compile

    def groups(n):
        return [{"params": [torch.empty(n, device="meta", requires_grad=True)]}]

    assert build_config({}).optimizer.compile == "auto"
    assert not resolve_compile("auto", groups(COMPILE_AUTO_MIN_PARAMS - 1))
    assert resolve_compile("auto", groups(COMPILE_AUTO_MIN_PARAMS))
    assert resolve_compile(True, groups(10)) and not resolve_compile(False, groups(1 << 30))
    for setting, n, want in [("auto", 1000, False), ("auto", COMPILE_AUTO_MIN_PARAMS, True),
                             (True, 1000, True)]:
        cfg = build_config({"optimizer": {"compile": setting}}).optimizer
        opt = build_optimizer(cfg, groups(n))
        assert opt.param_groups[0]["compiled"] is want
    with pytest.raises(Exception, match="compile"):
        build_config({"optimizer": {"compile": "sometimes"}})
    assert build_config({"optimizer": {"compile": 1}}).optimizer.compile is True
    # torch.optim's other ways of passing params still give every parameter to the optimizer
    cfg = build_config({}).optimizer
    model = torch.nn.Linear(3, 2)
    for params in (model.parameters(), [{"params": model.parameters()}]):
        opt = build_optimizer(cfg, params)
        assert sum(len(g["params"]) for g in opt.param_groups) == 2


def test_mismatched_state_is_a_clear_error():
    p = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"shape \(3,\) does not match the parameter's \(4, 3\)"):
        functional.adamw_(p, torch.ones(4, 3), torch.zeros(3), torch.zeros(4, 3), step=1, lr=0.1)


def test_zero_lr_moves_moments_not_params():
    """Warmup from 0 makes the first lr 0: θ must stay put (no 0/0), m and v still update."""
    p = torch.randn(100)
    g = torch.randn(100)
    m, v, q = torch.zeros(100), torch.zeros(100), p.clone()
    functional.adamw_(q, g, m, v, step=1, lr=0.0, weight_decay=0.1)
    assert torch.equal(q, p) and m.abs().sum() > 0 and v.abs().sum() > 0


def test_adagrad_group_added_later_gets_state():
    a, b = torch.zeros(3), torch.zeros(2)
    opt = Adagrad([a], lr=0.1, initial_accumulator_value=0.5)
    opt.add_param_group({"params": [b]})
    a.grad, b.grad = torch.ones(3), torch.ones(2)
    opt.step()
    assert torch.allclose(opt.state[b]["sum"], torch.full((2,), 1.5))


def test_params_without_grad_are_untouched():
    a, b = torch.randn(4), torch.randn(4)
    a.grad = torch.ones(4)
    opt = AdamW([a, b], lr=0.1)
    before = b.clone()
    opt.step()
    assert torch.equal(b, before) and len(opt.state[b]) == 0
    assert float(opt.state[a]["step"]) == 1.0
    opt.zero_grad()
    assert a.grad is None


# ----------------------------------------------------------------------------- Lion, Muon


def lion_reference(p, g, m, lr, beta1, beta2, wd):
    """Chen et al. 2023, Program 1: update = sign(β1·m + (1−β1)·g); θ −= lr·(update + λθ)."""
    update = torch.sign(beta1 * m + (1 - beta1) * g)
    p = p - lr * (update + wd * p)
    m = beta2 * m + (1 - beta2) * g
    return p, m


def test_lion_matches_paper():
    gen = torch.Generator().manual_seed(0)
    shapes = [(40, 30), (50,)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(200)]
    params = [x.clone() for x in init]
    opt = Lion(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.3)
    ref_p, ref_m = [x.double() for x in init], [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for k in range(200):
        for p, g in zip(params, grads[k]):
            p.grad = g
        opt.step()
        for i in range(len(shapes)):
            ref_p[i], ref_m[i] = lion_reference(ref_p[i], grads[k][i].double(), ref_m[i],
                                                1e-3, 0.9, 0.99, 0.3)
    for p, r in zip(params, ref_p):
        assert_close(p, r.float(), rtol=1e-5)
    # every coordinate of a Lion step has magnitude exactly lr (plus the decay)
    before = params[0].clone()
    params[0].grad = torch.randn(shapes[0], generator=gen)
    params[1].grad = torch.randn(shapes[1], generator=gen)
    opt.step()
    step = (params[0] - before * (1 - 1e-3 * 0.3)).abs()
    assert torch.allclose(step, torch.full_like(step, 1e-3), rtol=1e-3)


NS_COEFFS = (3.4445, -4.7750, 2.0315)


def ns_reference(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Jordan et al. 2024: X ← aX + b(XXᵀ)X + c(XXᵀ)²X on the wide orientation, float64."""
    a, b, c = NS_COEFFS
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / X.norm()
    for _ in range(steps):
        A = X @ X.T
        X = a * X + b * A @ X + c * A @ A @ X
    return X.T if tall else X


def test_newton_schulz_matches_reference_and_orthogonalises():
    gen = torch.Generator().manual_seed(0)
    for shape in [(64, 128), (128, 64), (50, 50)]:
        # singular values spread over [0.1, 1]: condition number 10
        u, _ = torch.linalg.qr(torch.randn(shape[0], min(shape), generator=gen))
        w, _ = torch.linalg.qr(torch.randn(shape[1], min(shape), generator=gen))
        s = torch.linspace(0.1, 1.0, min(shape))
        G = u @ torch.diag(s) @ w.T
        ours = muon.newton_schulz(G)
        assert_close(ours, ns_reference(G).float(), rtol=1e-5)
        sv = torch.linalg.svdvals(ours)
        # the band we check, [0.65, 1.2]: these coefficients give about [0.68, 1.13]
        assert sv.min() > 0.65 and sv.max() < 1.2, (shape, sv.min(), sv.max())
        # and it keeps G's singular vectors: ours ≈ U·diag(σ')·Wᵀ with the same U, W
        inner = u.T @ ours @ w
        assert_close(inner, torch.diag(torch.diagonal(inner)), rtol=1e-4)


def muon_reference_step(p, g, buf, *, lr, mu, nesterov, wd):
    """Jordan et al. 2024 (sum-form momentum) with Liu et al. 2025's 0.2·√max(A, B) lr scale."""
    buf = mu * buf + g
    u = g + mu * buf if nesterov else buf
    o = ns_reference(u)
    p = p * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(p.shape)) * o
    return p, buf


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_reference_and_falls_back_to_adamw(nesterov):
    gen = torch.Generator().manual_seed(2)
    mats = [torch.randn(32, 48, generator=gen), torch.randn(40, 24, generator=gen)]
    vecs = [torch.randn(48, generator=gen), torch.randn(24, generator=gen)]
    ours_m, ours_v = [x.clone() for x in mats], [x.clone() for x in vecs]
    ref_m, ref_buf = [x.double() for x in mats], [torch.zeros_like(x).double() for x in mats]
    ref_v = [x.clone() for x in vecs]
    opt = Muon(ours_m + ours_v, lr=0.01, weight_decay=0.1, momentum=0.9, nesterov=nesterov,
               adamw_betas=(0.9, 0.95), adamw_eps=1e-8)
    adamw = torch.optim.AdamW(ref_v, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(30):
        gm = [torch.randn(x.shape, generator=gen) + x for x in ours_m]  # a pull toward 0
        gv = [torch.randn(x.shape, generator=gen) for x in vecs]
        for p, g in zip(ours_m + ours_v, gm + gv):
            p.grad = g
        for p, g in zip(ref_v, gv):
            p.grad = g
        opt.step()
        adamw.step()
        for i in range(2):
            ref_m[i], ref_buf[i] = muon_reference_step(ref_m[i], gm[i].double(), ref_buf[i],
                                                       lr=0.01, mu=0.9, nesterov=nesterov,
                                                       wd=0.1)
    for a, b in zip(ours_m, ref_m):
        assert_close(a, b.float(), rtol=2e-5)
    for a, b in zip(ours_v, ref_v):
        assert_close(a, b)
    assert set(opt.state[ours_m[0]]) == {"momentum_buffer"}
    assert set(opt.state[ours_v[0]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_muon_use_muon_false_group_gets_adamw():
    emb = torch.randn(20, 8)
    emb.grad = torch.randn(20, 8)
    opt = Muon([{"params": [emb], "use_muon": False}], lr=0.01)
    opt.step()
    assert set(opt.state[emb]) == {"step", "exp_avg", "exp_avg_sq"}


def test_muon_original_lr_scaling():
    assert muon.muon_lr(0.02, (64, 16), "original") == pytest.approx(0.04)
    assert muon.muon_lr(0.02, (16, 64), "original") == pytest.approx(0.02)
    assert muon.muon_lr(1e-3, (64, 16), "match_rms_adamw") == pytest.approx(1.6e-3)


# ----------------------------------------------------------------------------- behaviour


def test_momentum_beats_sgd_on_ill_conditioned_quadratic():
    h = torch.tensor([1.0, 100.0])  # condition number 100
    losses = {}
    for mom in (0.0, 0.9):
        x = torch.tensor([1.0, 1.0])
        opt = SGD([x], lr=0.015, momentum=mom)
        for _ in range(100):
            x.grad = h * x
            opt.step()
        losses[mom] = float(0.5 * (h * x * x).sum())
    assert losses[0.9] < 1e-2 * losses[0.0], losses


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95)])
def test_adam_first_step_is_lr_per_coordinate(betas):
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(1000, generator=gen).sign() * torch.logspace(-2, 2, 1000)  # 4 decades
    lr = 1e-3
    p = torch.zeros(1000)
    m, v = torch.zeros(1000), torch.zeros(1000)
    functional.adam_(p, g, m, v, step=1, lr=lr, beta1=betas[0], beta2=betas[1])
    assert torch.allclose(p.abs(), torch.full_like(p, lr), rtol=1e-3)
    # the same kernel at step 10^9 has bias corrections ≈ 1, i.e. none: the first step
    # would be lr·(1−β1)/√(1−β2) — 3.2·lr for β2=0.999 (too large), 0.45·lr for 0.95
    q = torch.zeros(1000)
    m, v = torch.zeros(1000), torch.zeros(1000)
    functional.adam_(q, g, m, v, step=10**9, lr=lr, beta1=betas[0], beta2=betas[1])
    ratio = (1 - betas[0]) / math.sqrt(1 - betas[1])
    assert torch.allclose(q.abs(), torch.full_like(q, lr * ratio), rtol=1e-3)
    assert abs(math.log(ratio)) > math.log(2)  # far from lr either way


def test_adagrad_effective_step_shrinks():
    x = torch.zeros(3)
    opt = Adagrad([x], lr=0.1)
    steps = []
    for _ in range(50):
        before = x.clone()
        x.grad = torch.ones(3)
        opt.step()
        steps.append(float((x - before).abs().max()))
    assert all(a > b for a, b in itertools.pairwise(steps))
    assert steps[-1] == pytest.approx(steps[0] / math.sqrt(50), rel=1e-4)


def decay_amount(cls, grad_scale: float) -> float:
    """How far weight decay moves θ over 20 steps, for gradients scaled by grad_scale."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(200, generator=gen) for _ in range(20)]
    init = torch.randn(200, generator=gen) + 3
    ends = []
    for wd in (0.0, 0.1):
        x = init.clone()
        opt = cls([x], lr=0.01, weight_decay=wd)
        for g in grads:
            x.grad = g * grad_scale
            opt.step()
        ends.append(x)
    return float((ends[0] - ends[1]).abs().mean())


def test_adamw_decay_ignores_gradient_scale_but_adam_l2_does_not():
    w1, w1000 = decay_amount(AdamW, 1.0), decay_amount(AdamW, 1000.0)
    assert w1 == pytest.approx(w1000, rel=1e-3)
    a1, a1000 = decay_amount(Adam, 1.0), decay_amount(Adam, 1000.0)
    assert a1 > 50 * a1000  # λθ drowns in a 1000× larger gradient


# ----------------------------------------------------------------------------- registry


def test_state_bytes_per_param():
    expected = {"adamw": 8, "adam": 8, "sgd": 0, "adagrad": 4, "rmsprop": 4, "lion": 4, "muon": 4}
    for name, k in expected.items():
        assert state_bytes_per_param(name) == k
        assert OPTIMIZERS[name].state_bytes_per_param() == k
    assert state_bytes_per_param("sgd", momentum=0.9) == 4
    assert state_bytes_per_param("rmsprop", momentum=0.9) == 8
    assert RMSprop.state_bytes_per_param(momentum=0.9, centered=True) == 12
    with pytest.raises(ValueError, match="unknown optimizer"):
        state_bytes_per_param("adafactor")


def test_state_bytes_match_allocated_state():
    for name, hyper in [("adamw", {}), ("sgd", {"momentum": 0.9}), ("adagrad", {}),
                        ("rmsprop", {"momentum": 0.9}), ("lion", {}), ("muon", {})]:
        p = torch.zeros(64, 32)
        p.grad = torch.ones(64, 32)
        opt = OPTIMIZERS[name]([p], **hyper)
        opt.step()
        nbytes = sum(t.numel() * t.element_size() for t in opt.state[p].values() if t.ndim)
        assert nbytes == state_bytes_per_param(name, hyper.get("momentum", 0.0)) * p.numel()


def test_build_optimizer_maps_config():
    def build(**kw):
        p = torch.zeros(4, 4)
        return build_optimizer(OptimizerConfig(**kw), [{"params": [p], "weight_decay": 0.0}])

    opt = build(name="adamw", lr=3e-4, betas=(0.8, 0.9), eps=1e-6)
    assert isinstance(opt, AdamW)
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (3e-4, (0.8, 0.9), 1e-6, 0.0)
    opt = build(name="sgd", momentum=0.9, nesterov=True)
    assert isinstance(opt, SGD) and opt.param_groups[0]["nesterov"]
    assert build(name="rmsprop", alpha=0.9).param_groups[0]["alpha"] == 0.9
    assert build(name="adagrad", lr_decay=0.1).param_groups[0]["lr_decay"] == 0.1
    assert isinstance(build(name="lion"), Lion)
    assert isinstance(build(name="adam"), Adam)
    muon = build(name="muon", ns_steps=3)
    assert muon.param_groups[0]["momentum"] == 0.95 and muon.param_groups[0]["ns_steps"] == 3
    assert build(name="muon", momentum=0.8).param_groups[0]["momentum"] == 0.8
