"""Expert parallelism (`model.moe.expert_parallel`, models/moe_parallel.py, zero/experts.py):
EP = 2 and 4 on 4 ranks equal one process at ZeRO-0/1/2/3 (SGD: every updated parameter
is the gradient; AdamW and bf16 too), whatever the routing — all pairs to two experts (the
others idle, a rank whose experts get nothing), a rank with no tokens at all; the
all-to-all's bytes equal the count from the routing; each rank holds 1/P of the experts;
checkpoints resume at another EP degree; bad settings are one error each."""

import pytest
import torch

from test_moe_zero import route

from multirank import run_ranks
from zero_harness import batches, make_config, rel_err

E = 4
MOE = {"arch": "llama", "n_kv_head": 1, "intermediate_size": 16,
       "moe": {"experts": E, "top_k": 2, "aux_loss": 0.0, "z_loss": 0.01}}
SKEW = [30.0, 20.0, 0.0, 0.0]  # every pair to experts 0 and 1


def cfg_for(stage: int, ep: int, world: int, steps: int, **extra):
    model = {**MOE, "moe": {**MOE["moe"], "expert_parallel": ep}}
    over = {"model": model, "zero": {"stage": stage},
            "optimizer": {"name": extra.pop("opt", "sgd"), "lr": 0.05, "grad_clip": 0.0}}
    for k, v in extra.items():
        over.setdefault(k, {}).update(v)
    return make_config(over, world, steps)


def engine(cfg):
    from zerotrain.engine import Engine
    from zerotrain.models import build_model

    torch.manual_seed(0)
    return Engine(build_model(cfg.model), cfg, torch.device("cpu"))


def steps_of(eng, steps: int, after=None) -> tuple[list[float], list[float]]:
    """`steps` steps on this rank's slice of the shared batches: the world's mean loss and
    the gradient norm per step; `after()` runs after each step."""
    from zerotrain.comm.dist import world

    rank, n = world()
    b = eng.config.data.micro_batch_size
    losses, norms = [], []
    for X, Y in batches(steps):
        loss = eng(X[rank * b:(rank + 1) * b], Y[rank * b:(rank + 1) * b])
        eng.backward(loss)
        info = eng.step()
        losses.append(float(eng.comm.all_reduce_scalars([loss.item()])[0]) / n)
        norms.append(info.grad_norm)
        if after is not None:
            after()
    return losses, norms


def whole(eng) -> dict[str, torch.Tensor]:
    """Every parameter in full: experts from every slot of the EP group (all-gathered)."""
    import torch.distributed as dist

    out = {}
    with eng.full_parameters():
        for n, p in eng.module.named_parameters():
            t = p.detach().float().clone()
            if ".mlp.experts." in n and dist.is_initialized():
                P = eng.config.model.moe.expert_parallel
                parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
                dist.all_gather(parts, t)
                t = torch.cat(parts[:P]) if P > 1 else t
            out[n] = t
    return out


def train(stage: int, ep: int, steps: int = 3, bias=None, **extra) -> dict:
    from zerotrain.comm.dist import world
    from zerotrain.models.moe import take_stats

    n = world()[1]
    cfg = cfg_for(stage, ep, n, steps, **extra)
    eng = engine(cfg)
    route(eng, bias)
    sent, counts = [], []

    def record() -> None:
        a2a = eng.last_traffic.get("experts", {}).get("all_to_all", {})
        sent.append(a2a.get("sent_bytes", 0))
        counts.append(take_stats(eng.module)[:, :E].tolist())
    losses, norms = steps_of(eng, steps, record)
    experts = sum(p.numel() for m, p in eng.module.named_parameters() if ".experts." in m)
    res = {"params": whole(eng), "losses": losses, "norms": norms, "sent": sent,
           "counts": counts, "expert_numel": experts}
    eng.close()
    return res


def run_cases(cases: list[tuple]) -> list[dict]:
    return [train(*c[:2], **c[2]) for c in cases]


def close(res: dict, ref: dict, what: str, tol: float = 1e-4) -> None:
    for a, b in zip(res["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"{what}: loss {a} vs {b}"
    for a, b in zip(res["norms"], ref["norms"], strict=True):
        assert abs(a - b) <= 1e-5 * b, f"{what}: grad norm {a} vs {b}"
    err = rel_err(res["params"], ref["params"])
    assert err < tol, f"{what}: parameters differ by {err:.2e}"


def a2a_theory(counts: list[list[list[float]]], rank: int, ep: int, d: int,
               recompute: bool = False) -> int:
    """Bytes rank `rank` sends in one step: per layer, its pairs for other slots' experts
    and the pairs it computed for the others, each twice (forward, backward; three times
    when activation checkpointing recomputes the forward), fp32 rows of d; plus the
    counts (E - E/P int64) it tells the others (twice when recomputed)."""
    L, start = E // ep, rank - rank % ep
    total = 0
    for layer in range(len(counts[rank])):
        mine = range((rank % ep) * L, (rank % ep + 1) * L)
        out = sum(c for e, c in enumerate(counts[rank][layer]) if e not in mine)
        into = sum(counts[s][layer][e] for s in range(start, start + ep) if s != rank
                   for e in mine)
        total += int((2 + recompute) * (out + into) * d * 4 + (1 + recompute) * (E - L) * 8)
    return total


def test_expert_parallel_equals_one_process():
    cases = [(0, 2, {}), (1, 4, {}), (2, 2, {"comm": {"algorithm": "ring"}}), (3, 4, {}),
             (3, 2, {"bias": SKEW}),
             (3, 2, {"model": {"activation_checkpointing": True}}), (3, 2, {"opt": "adamw"})]
    refs = {"plain": train(0, 1), "skew": train(0, 1, bias=SKEW),
            "adamw": train(0, 1, opt="adamw")}
    out = run_ranks(run_cases, 4, cases)
    for i, (stage, ep, extra) in enumerate(cases):
        key = "skew" if "bias" in extra else extra.get("opt", "plain")
        for r in range(4):
            close(out[r][i], refs[key], f"rank {r}, stage {stage}, EP {ep}, {key}")
            # each rank holds 1/P of the experts
            assert out[r][i]["expert_numel"] * ep == refs[key]["expert_numel"]
            # the all-to-all's bytes are what the routing says
            for step, sent in enumerate(out[r][i]["sent"]):
                counts = [out[s][i]["counts"][step] for s in range(4)]
                again = "model" in extra  # activation checkpointing
                assert sent == a2a_theory(counts, r, ep, 32, again), (stage, ep, key, r, step)
    # skewed: experts 2 and 3 got nothing, so their ranks received no pair
    assert all(row[2:] == [0.0, 0.0] for row in out[0][4]["counts"][0])


def empty_rank_layer() -> dict:
    """One MoE layer on 2 ranks, EP 2, rank 1 with no tokens at all: both finish, and
    rank 0's output and gradients equal the whole layer's in one process."""
    from zerotrain.comm.collectives import Comm
    from zerotrain.config import build_config
    from zerotrain.models.moe import MoE
    from zerotrain.models.moe_parallel import attach

    rank = torch.distributed.get_rank()
    cfg = build_config({"model": {**MOE, "n_layer": 1, "n_head": 2, "n_embd": 32,
                                  "moe": {**MOE["moe"], "expert_parallel": 2}}})
    torch.manual_seed(0)
    layer = MoE(cfg.model)
    torch.manual_seed(1)
    x = torch.randn(10, 32)
    full = torch.randn(E, *layer.experts.gate_up.shape[1:]), torch.randn(
        E, *layer.experts.down.shape[1:])
    with torch.no_grad():
        layer.experts.gate_up.copy_(full[0][rank * 2:rank * 2 + 2])
        layer.experts.down.copy_(full[1][rank * 2:rank * 2 + 2])
    comm = Comm("native", check_lockstep=True)
    attach(layer.experts, comm)
    x_in = (x if rank == 0 else x[:0]).clone().requires_grad_()
    y = layer(x_in)
    (y.square().sum()).backward()
    res = {"y": y.detach(), "dx": x_in.grad, "router": layer.router.weight.grad.clone(),
           "gate_up": layer.experts.gate_up.grad.clone(), "router_w": layer.router.weight,
           "full": full, "x": x, "sent": comm.counter.snapshot()}
    comm.close()
    return res


def test_rank_without_tokens_finishes_and_matches():
    from zerotrain.config import build_config
    from zerotrain.models.moe import MoE

    r0, r1 = run_ranks(empty_rank_layer, 2)
    assert r1["y"].shape == (0, 32)
    cfg = build_config({"model": {**MOE, "n_layer": 1, "n_head": 2, "n_embd": 32}})
    layer = MoE(cfg.model)
    with torch.no_grad():
        layer.router.weight.copy_(r0["router_w"])
        layer.experts.gate_up.copy_(r0["full"][0])
        layer.experts.down.copy_(r0["full"][1])
    x = r0["x"].clone().requires_grad_()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: gradients of ~1e5 cancel, so the matmuls'
    try:  # split across threads would move them by more than the bounds below
        y = layer(x)
        y.square().sum().backward()
    finally:
        torch.set_num_threads(threads)
    assert torch.allclose(r0["dx"], x.grad, atol=1e-5)
    assert torch.allclose(r0["y"], y, atol=1e-6)
    assert torch.allclose(r0["router"], layer.router.weight.grad, atol=1e-5)
    got = torch.cat([r0["gate_up"], r1["gate_up"]])  # rank 1's experts: rank 0's tokens
    assert torch.allclose(got, layer.experts.gate_up.grad, atol=1e-5)
    for r in (r0, r1):  # counts; out and back; both again in backward
        assert r["sent"]["experts"]["all_to_all"]["calls"] == 5


def resume(stage: int, ep: int, path: str, save: bool, **extra) -> dict:
    """AdamW: two steps and a checkpoint (`save`), or that checkpoint loaded; then the
    third step. Its parameters are the same whatever the EP degree, stage or world."""
    from zerotrain.comm.dist import world

    rank, n = world()
    cfg = cfg_for(stage, ep, n, 3, opt="adamw", **extra)
    eng = engine(cfg)
    b = cfg.data.micro_batch_size
    pool = list(batches(3))

    def step(X, Y) -> None:
        eng.backward(eng(X[rank * b:(rank + 1) * b], Y[rank * b:(rank + 1) * b]))
        eng.step()

    if save:
        for X, Y in pool[:2]:
            step(X, Y)
        eng.save_checkpoint(path, tag="s2")
    else:
        eng.load_checkpoint(path, tag="s2")
    step(*pool[2])
    res = {"params": whole(eng), "resharded": bool(eng.last_load and eng.last_load.resharded)}
    eng.close()
    return res


def resume_cases(cases: list[tuple]) -> list[dict]:
    return [resume(*c[:4], **c[4]) for c in cases]


def test_offload_bf16_and_checkpoints_across_ep_degrees(tmp_path):
    a, b = str(tmp_path / "ep2"), str(tmp_path / "one")
    cpu = {"zero": {"offload_optimizer": "cpu"}}
    bf16 = {"precision": {"dtype": "bf16"}}
    ref = resume(0, 1, b, True)  # one process: saves a checkpoint, steps on
    cases = [(3, 2, a, True, cpu),    # EP 2, ZeRO-3 + Offload: saves, steps on
             (2, 4, a, False, cpu),   # EP 4, ZeRO-2 + Offload: resumes EP 2's checkpoint
             (1, 2, b, False, {})]    # EP 2 resumes one process's checkpoint
    out = run_ranks(resume_cases, 4, cases)
    bf = run_ranks(run_cases, 4, [(2, 2, bf16), (2, 1, bf16)])
    for r in range(4):
        for i in range(3):
            err = rel_err(out[r][i]["params"], ref["params"])
            assert err < 1e-4, f"case {cases[i][:2]}, rank {r}: {err:.2e}"
        assert out[r][1]["resharded"]
        # bf16: EP 2 follows EP 1 at ZeRO-2 (up to bf16's rounding of other sums)
        assert abs(bf[r][0]["losses"][-1] - bf[r][1]["losses"][-1]) < 1e-2
        assert rel_err(bf[r][0]["params"], bf[r][1]["params"]) < 1e-2
    # EP 2's checkpoint in one process at EP 1: the experts reassembled from both slots
    one = resume(1, 1, a, False)
    assert rel_err(one["params"], ref["params"]) < 1e-4


def test_bad_expert_parallel_settings_name_the_field():
    from zerotrain.config import ConfigError, build_config
    from zerotrain.config.nodes import check_nodes

    def error(model: dict, extra: dict | None = None) -> str:
        with pytest.raises((ConfigError, ValueError)) as e:
            build_config({"model": model, **(extra or {})})
        return str(e.value)

    moe = {**MOE["moe"], "expert_parallel": 3}
    assert "model.moe.expert_parallel (3) must divide model.moe.experts (4)" in error(
        {**MOE, "moe": moe})
    assert "model.moe.top_k (5) exceeds" in error({**MOE, "moe": {**MOE["moe"], "top_k": 5}})
    two = {**MOE, "moe": {**MOE["moe"], "expert_parallel": 2}}
    assert "sequence.parallel with model.moe.expert_parallel" in error(
        two, {"sequence": {"parallel": 2}})
    cfg = build_config({"model": two})
    check_nodes(cfg, 4)  # fine
    with pytest.raises(ConfigError, match=r"model.moe.expert_parallel \(2\) must divide the "
                       r"world size \(3\)"):
        check_nodes(cfg, 3)
    assert "remove model.moe" in error({"hf": "gpt2", "moe": {"experts": 4}})
    # one process (sample, export) builds every expert: EP is a multi-rank layout
    from zerotrain.models import build_model

    assert build_model(cfg.model, device="meta").blocks[0].mlp.experts.gate_up.shape[0] == E


def train_hf(folder: str, stage: int, ep: int, steps: int = 3) -> dict:
    """A transformers Qwen3-MoE folder as `zerotrain train` builds it (meta device, weights
    read by slice: each rank reads only its experts' rows), its experts swapped for
    expert-parallel ones (models/hf_experts.py)."""
    from zerotrain.comm.dist import world
    from zerotrain.run.setup import build

    n = world()[1]
    moe = {"moe": {"expert_parallel": ep}} if ep > 1 else {}
    cfg = make_config({"model": {"hf": folder, "n_layer": None, "n_head": None,
                                 "n_embd": None, **moe}, "zero": {"stage": stage},
                       "optimizer": {"name": "sgd", "lr": 0.05, "grad_clip": 0.0}}, n, steps)
    eng = build(cfg, torch.device("cpu"))
    losses, norms = steps_of(eng, steps)
    experts = sum(p.numel() for m, p in eng.module.named_parameters() if ".experts." in m)
    res = {"params": whole(eng), "losses": losses, "norms": norms, "expert_numel": experts}
    eng.close()
    return res


def hf_cases(folder: str, cases: list[tuple]) -> list[dict]:
    return [train_hf(folder, *c) for c in cases]


def test_hf_qwen3_moe_expert_parallel_equals_one_process(tmp_path):
    import transformers

    torch.manual_seed(5)
    conf = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=48,
                                       moe_intermediate_size=16, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       num_experts=4, num_experts_per_tok=2, head_dim=8,
                                       max_position_embeddings=16)
    transformers.Qwen3MoeForCausalLM(conf).save_pretrained(tmp_path / "qwen")
    folder = str(tmp_path / "qwen")
    ref = train_hf(folder, 0, 1)
    cases = [(3, 2), (1, 4)]
    out = run_ranks(hf_cases, 4, folder, cases)
    for r in range(4):
        for i, (stage, ep) in enumerate(cases):
            close(out[r][i], ref, f"HF Qwen3-MoE rank {r}, stage {stage}, EP {ep}")
            assert out[r][i]["expert_numel"] * ep == ref["expert_numel"]


def parting() -> str:
    """Rank 0 exchanges experts' rows while rank 1 runs another collective: the lockstep
    check (the EP group is checked in the world's sequence) names both, no hang."""
    from zerotrain.comm.autograd import all_to_all_rows
    from zerotrain.comm.collectives import Comm
    from zerotrain.comm.lockstep import LockstepError

    comm = Comm("native", check_lockstep=True)
    ep = comm.split(2)
    try:
        if comm.rank == 0:
            all_to_all_rows(ep, torch.ones(2, 3), [1, 1], [1, 1])
        else:
            comm.all_reduce(torch.ones(3))
        return "no error"
    except LockstepError as e:
        return str(e)
    finally:
        comm.close()


def test_lockstep_names_a_rank_that_skips_the_exchange():
    for msg in run_ranks(parting, 2):
        assert "all_to_all(experts on the 2-rank split groups)" in msg, msg
        assert "all_reduce(grads)" in msg, msg
