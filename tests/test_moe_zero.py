"""The MoE llama under ZeRO-1/2/3 on 2 ranks equals one process, whatever the routing:
natural, every token to two experts (the others idle), and each rank routing to experts
the other never uses (then no single process matches, but both ranks finish in lockstep).
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


def run_cases(cases: list[tuple]) -> list[dict]:
    return [train(*c) for c in cases]


def test_moe_under_zero_stages_equals_one_process():
    ref = {r: train(0, r) for r in ("natural", "two")}
    assert ref["natural"]["losses"][-1] < ref["natural"]["losses"][0]
    assert all(row[2:] == [0.0, 0.0] for row in ref["two"]["counts"])  # experts 2, 3 idle
    cases = [(1, "natural"), (2, "two"), (3, "natural"), (3, "two"), (3, "natural", True),
             (3, "per_rank")]
    out = run_ranks(run_cases, 2, cases)
    for case, res in zip(cases, out[0], strict=True):
        if case[1] == "per_rank":
            continue
        err = rel_err(res["params"], ref[case[1]]["params"])
        assert err < 1e-5, f"{case}: {err:.2e}"
    # each rank used only its own two experts, and both finished the same steps
    r0, r1 = out[0][-1]["counts"], out[1][-1]["counts"]
    assert all(row[2:] == [0.0, 0.0] for row in r0) and all(row[:2] == [0.0, 0.0] for row in r1)
    assert len(out[0][-1]["losses"]) == len(out[1][-1]["losses"]) == 4
    # under checkpointing the recompute does not count tokens twice
    assert out[0][4]["counts"] == out[0][2]["counts"]
