"""The llama family and a `model.hf` model (a Llama saved by transformers, loaded from its
folder through `pretrained_weights`) train under ZeRO stages on 2 ranks exactly as one
process does: their plans (units, groups) work with every strategy."""

import torch
import transformers

from zerotrain.models import build_model, plan_for

from multirank import run_ranks
from zero_harness import batches, built_engine, full_params, make_config, rel_err

SEQ = 16


def hf_llama_folder(tmp_path) -> str:
    torch.manual_seed(11)
    conf = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, max_position_embeddings=SEQ)
    transformers.LlamaForCausalLM(conf).save_pretrained(tmp_path / "hf")
    return str(tmp_path / "hf")


def model_overrides(kind: str, folder: str) -> dict:
    if kind == "llama":
        return {"model": {"arch": "llama", "n_kv_head": 1}}
    return {"model": {"hf": folder}}


def train(kind: str, folder: str, stage: int, steps: int = 6) -> dict:
    from zerotrain.comm.dist import world

    rank, n = world()
    cfg = make_config({**model_overrides(kind, folder), "zero": {"stage": stage}}, n, steps)
    eng = built_engine(cfg)
    b = cfg.data.micro_batch_size
    losses = []
    for X, Y in batches(steps):
        x, y = X[rank * b:(rank + 1) * b], Y[rank * b:(rank + 1) * b]
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    res = {"params": full_params(eng), "losses": losses, "units": len(eng.strategy.units)}
    eng.close()
    return res


def run_cases(cases: list[tuple[str, str, int]]) -> list[dict]:
    return [train(*c) for c in cases]


def test_llama_and_hf_model_under_zero_stages(tmp_path):
    folder = hf_llama_folder(tmp_path)
    ref = {kind: train(kind, folder, 0) for kind in ("llama", "hf")}
    for kind in ref:
        assert ref[kind]["losses"][-1] < ref[kind]["losses"][0]
    hf_model = build_model(make_config(model_overrides("hf", folder), 1, 6).model)
    assert len(plan_for(hf_model).blocks) == 2  # its decoder layers are the ZeRO-3 units
    cases = [("llama", folder, 3)] + [("hf", folder, s) for s in (0, 1, 2, 3)]
    for (kind, _, stage), res in zip(cases, run_ranks(run_cases, 2, cases)[0]):
        err = rel_err(res["params"], ref[kind]["params"])
        assert err < 1e-5, f"{kind} stage {stage}: {err:.2e}"
