"""The MoE llama under ZeRO-1/2/3 on 2 ranks equals one process, whatever the routing:
natural, every token to two experts (the others idle), and each rank routing to experts
the other never uses (then no single process matches, but both ranks finish in lockstep).
A Hugging Face Qwen3-MoE folder (per-expert on disk), each rank reading only the slices
of the fused experts it keeps, trains at ZeRO-3 on 2 ranks as one process does.
The load-balancing loss is per rank (f·P is not linear in the tokens), so the equality
cases set aux_loss 0; the z-loss is a mean over tokens and stays on."""

import torch
import torch.nn.functional as F

from multirank import run_ranks
from zero_harness import batches, built_engine, full_params, make_config, rel_err

SEQ = 16
MOE = {"arch": "llama", "n_kv_head": 1, "intermediate_size": 16,
       "moe": {"experts": 4, "top_k": 2, "aux_loss": 0.0, "z_loss": 0.01}}


def route(eng, bias: list[float] | None) -> None:
    if bias is None:
        return
    b = torch.tensor(bias)
    for blk in eng.module.blocks:
        r = blk.mlp.router
        r.forward = lambda h, r=r: F.linear(h, r.weight) + b.to(h.dtype)


def train(stage: int, routing: str, checkpointing: bool = False, steps: int = 4) -> dict:
    from zerotrain.comm.dist import world
    from zerotrain.models.moe import take_stats

    rank, n = world()
    model = {**MOE, "activation_checkpointing": checkpointing}
    cfg = make_config({"model": model, "zero": {"stage": stage}}, n, steps)
    eng = built_engine(cfg)
    bias = {"natural": None, "two": [30.0, 20.0, 0.0, 0.0],
            "per_rank": [30.0, 20.0, 0.0, 0.0] if rank == 0 else [0.0, 0.0, 20.0, 30.0]}
    route(eng, bias[routing])
    b = cfg.data.micro_batch_size
    losses = []
    for X, Y in batches(steps):
        loss = eng(X[rank * b:(rank + 1) * b], Y[rank * b:(rank + 1) * b])
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    stats = take_stats(eng.module)
    res = {"params": full_params(eng), "losses": losses, "counts": stats[:, :4].tolist()}
    eng.close()
    return res


def train_hf(folder: str, stage: int, steps: int = 4) -> dict:
    """Built as `zerotrain train` builds it: on the meta device, weights read by slice."""
    from zerotrain.comm.dist import world
    from zerotrain.run.setup import build

    rank, n = world()
    cfg = make_config({"model": {"hf": folder, "n_layer": None, "n_head": None,
                                 "n_embd": None}, "zero": {"stage": stage}}, n, steps)
    eng = build(cfg, torch.device("cpu"))
    b = cfg.data.micro_batch_size
    losses = []
    for X, Y in batches(steps):
        loss = eng(X[rank * b:(rank + 1) * b], Y[rank * b:(rank + 1) * b])
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    res = {"params": full_params(eng), "losses": losses}
    eng.close()
    return res


def run_cases(cases: list[tuple]) -> list[dict]:
    return [train_hf(*c[1:]) if c[0] == "hf" else train(*c) for c in cases]


def qwen_folder(tmp_path) -> str:
    import transformers

    torch.manual_seed(5)
    conf = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=48,
                                       moe_intermediate_size=16, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       num_experts=4, num_experts_per_tok=2, head_dim=8,
                                       max_position_embeddings=SEQ)
    transformers.Qwen3MoeForCausalLM(conf).save_pretrained(tmp_path / "qwen")
    return str(tmp_path / "qwen")


def test_moe_under_zero_stages_equals_one_process(tmp_path):
    folder = qwen_folder(tmp_path)
    ref = {r: train(0, r) for r in ("natural", "two")}
    ref["hf"] = train_hf(folder, 0)
    assert ref["hf"]["losses"][-1] < ref["hf"]["losses"][0]
    assert ref["natural"]["losses"][-1] < ref["natural"]["losses"][0]
    assert all(row[2:] == [0.0, 0.0] for row in ref["two"]["counts"])  # experts 2, 3 idle
    cases = [(1, "natural"), (2, "two"), (3, "natural"), (3, "two"), (3, "natural", True),
             (3, "per_rank"), ("hf", folder, 3)]
    out = run_ranks(run_cases, 2, cases)
    for case, res in zip(cases, out[0], strict=True):
        if case[1] == "per_rank":
            continue
        err = rel_err(res["params"], ref["hf" if case[0] == "hf" else case[1]]["params"])
        assert err < 1e-5, f"{case}: {err:.2e}"
    # each rank used only its own two experts, and both finished the same steps
    r0, r1 = out[0][5]["counts"], out[1][5]["counts"]
    assert all(row[2:] == [0.0, 0.0] for row in r0) and all(row[:2] == [0.0, 0.0] for row in r1)
    assert len(out[0][5]["losses"]) == len(out[1][5]["losses"]) == 4
    # under checkpointing the recompute does not count tokens twice
    assert out[0][4]["counts"] == out[0][2]["counts"]
