"""The native MoE family (`model.moe` on llama): the same function as transformers'
Mixtral, dropless or with a capacity, router losses by their formulas, parameter counts,
one config error per bad setting, and the router statistics the loop logs."""

import math

import pytest
import torch
import torch.nn.functional as F
import transformers

from zerotrain.config import ConfigError, ModelConfig, build_config
from zerotrain.models import build_model, count_params, pretrained_weights
from zerotrain.models.hf_export import save_hf
from zerotrain.models.moe import MoE, stats_record, take_stats
from zerotrain.models.presets import active_params, resolve_model_config

IDX = torch.randint(0, 80, (2, 24), generator=torch.Generator().manual_seed(0))


def moe_cfg(**moe) -> ModelConfig:
    return ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                       intermediate_size=16, block_size=24, vocab_size=80,
                       moe={"experts": 4, "top_k": 2, **moe})


def force(layer: MoE, bias: list[float]) -> None:
    """Route by a fixed logit offset on top of the router (skewed routing on demand)."""
    b = torch.tensor(bias)
    layer.router.forward = lambda h: F.linear(h, layer.router.weight) + b.to(h.dtype)


def naive(layer: MoE, x: torch.Tensor, cap: int | None = None) -> torch.Tensor:
    """Token by token: softmax, top-k renormalised, SwiGLU experts; with `cap`, pairs
    admitted first choices first, in token order, until an expert is full."""
    h = x.reshape(-1, x.shape[-1])
    w, idx = layer.router(h).float().softmax(-1).topk(layer.k, -1)
    w = w / w.sum(-1, keepdim=True)
    out, seen = torch.zeros_like(h), [0] * layer.n
    for j in range(layer.k):
        for t in range(h.shape[0]):
            e = int(idx[t, j])
            seen[e] += 1
            if cap is not None and seen[e] > cap:
                continue
            gu = layer.experts.gate_up[e] @ h[t]
            g, u = gu.chunk(2)
            out[t] += w[t, j] * (layer.experts.down[e] @ (F.silu(g) * u))
    return out.view(x.shape)


def test_moe_llama_is_mixtral(tmp_path):
    """Export as MixtralForCausalLM (per-expert on disk): the same logits; and back."""
    torch.manual_seed(0)
    model = build_model(moe_cfg()).eval()
    save_hf(tmp_path / "hf", model.cfg, model.state_dict())
    twin = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(twin).__name__ == "MixtralForCausalLM"
    assert (twin(input_ids=IDX).logits - model(IDX)).abs().max().item() < 1e-5
    back = build_model(moe_cfg().model_copy(update={"init_from": str(tmp_path / "hf")}))
    pretrained_weights(back.cfg, back).load_into(back)
    assert torch.equal(back.eval()(IDX), model(IDX))


@pytest.mark.parametrize("bias", [None, [30.0, 20.0, 0.0, 0.0]])
def test_dropless_equals_token_by_token(bias):
    """Every pair computed, also when every token goes to experts 0 and 1 (2, 3 idle)."""
    torch.manual_seed(1)
    layer = build_model(moe_cfg()).blocks[0].mlp
    if bias:
        force(layer, bias)
    x = torch.randn(3, 5, 32)
    y = layer(x)
    assert (y - naive(layer, x)).abs().max().item() < 1e-5
    y.square().sum().backward()  # idle experts: zero gradients, never None
    g = layer.experts.gate_up.grad
    assert g is not None and (bias is None or float(g[2:].abs().sum()) == 0.0)


def test_capacity_drops_second_choices_first():
    torch.manual_seed(2)
    layer = build_model(moe_cfg(capacity_factor=1.0)).blocks[0].mlp.train()
    force(layer, [30.0, 20.0, 0.0, 0.0])  # 15 tokens x 2 pairs, all to experts 0 and 1
    x = torch.randn(3, 5, 32)
    cap = math.ceil(1.0 * 15 * 2 / 4)  # 8 per expert
    assert (layer(x) - naive(layer, x, cap)).abs().max().item() < 1e-5
    rec = stats_record(take_stats(layer))
    assert rec["tokens_per_expert"] == [[8, 8, 0, 0]] and rec["dropped"] == 30 - 16


def test_router_losses_and_stats():
    """aux = E·Σ f_e·P_e and z = mean(logsumexp²), added (weighted, mean over layers) to
    the training loss only; the counts the loop logs are the routed pairs."""
    torch.manual_seed(3)
    model = build_model(moe_cfg(aux_loss=0.5, z_loss=0.25)).train()
    tgt = torch.roll(IDX, -1, 1)
    seen = []
    for blk in model.blocks:
        blk.mlp.register_forward_hook(lambda m, a, o: seen.append(a[0].detach()))
    loss = model(IDX, tgt)
    expect = []
    for blk, x in zip(model.blocks, seen, strict=True):
        logits = blk.mlp.router(x.reshape(-1, 32)).float()
        p = logits.softmax(-1)
        top = p.topk(2, -1).indices
        f = torch.bincount(top.reshape(-1), minlength=4).float() / top.numel()
        aux = 4 * (f * p.mean(0)).sum()
        z = torch.logsumexp(logits, -1).square().mean()
        expect.append(0.5 * aux + 0.25 * z)
    ce = model.eval()(IDX, tgt)
    assert abs(loss.item() - ce.item() - torch.stack(expect).mean().item()) < 1e-5
    rec = stats_record(take_stats(model))
    assert [sum(r) for r in rec["tokens_per_expert"]] == [2 * 48, 2 * 48]
    assert rec["imbalance"] >= 1.0 and take_stats(model) is None  # reset once taken


def test_preset_counts_total_and_active():
    c = resolve_model_config(ModelConfig(preset="llama-moe-tiny", vocab_size=256))
    dense = resolve_model_config(ModelConfig(preset="llama-tiny", vocab_size=256))
    assert c.moe is not None and c.moe.experts == 8 and c.moe.top_k == 2
    with torch.device("meta"):
        built = sum(p.numel() for p in build_model(c).parameters())
    assert count_params(c) == built == 2_626_688
    # top-2 of 8 experts at half the dense width: the dense model plus the routers
    assert active_params(c) == count_params(dense) + 4 * 128 * 8
    # a user's model.moe field keeps the preset's others
    mine = resolve_model_config(ModelConfig(preset="llama-moe-tiny", moe={"top_k": 1}))
    assert (mine.moe.experts, mine.moe.top_k) == (8, 1)


@pytest.mark.parametrize("moe,extra,field", [
    ({"experts": 4, "top_k": 5}, {"arch": "llama"}, "model.moe.top_k"),
    ({"experts": 6, "expert_parallel": 4}, {"arch": "llama"}, "model.moe.expert_parallel"),
    ({"experts": 4, "expert_parallel": 2}, {"hf": "/some/folder"}, "model.moe"),
    ({"experts": 4}, {"arch": "gpt"}, "model.moe"),
    ({"experts": 4}, {"hf": "/some/folder"}, "model.moe"),
    ({"experts": 4}, {"arch": "llama", "bias": True}, "model.bias"),
    ({"experts": 4}, {"arch": "llama", "optimizer": "muon"}, "optimizer.name muon"),
])
def test_bad_moe_settings_are_one_config_error(moe, extra, field):
    opt = {"optimizer": {"name": extra.pop("optimizer")}} if "optimizer" in extra else {}
    with pytest.raises(ConfigError) as e:
        build_config({"model": {**extra, "moe": moe}, **opt})
    assert field in str(e.value) and "\n" not in str(e.value).strip()


@pytest.mark.parametrize("experts,top_k", [(4, 2), (8, 1)])
def test_activation_model_counts_moe_saved_tensors(experts, top_k):
    """memory/activations.py's MoE block against the bytes autograd really saves."""
    from test_memory_model import _saved_bytes
    from zerotrain.memory.activations import activation_parts

    c = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                    intermediate_size=32, block_size=32, vocab_size=256,
                    moe={"experts": experts, "top_k": top_k})
    dense = c.model_copy(update={"moe": None})
    torch.manual_seed(0)
    b, s = 3, 32
    idx, tgt = torch.randint(0, 256, (2, b, s))
    got = _saved_bytes(build_model(c).train(), idx, tgt)
    got_dense = _saved_bytes(build_model(dense).train(), idx, tgt)
    want = activation_parts(c, b, s, act_bytes=4).saved
    want_dense = activation_parts(dense, b, s, act_bytes=4).saved
    # the MoE's blocks save more than the dense ones, and the model says how much
    extra, want_extra = sum(got.values()) - sum(got_dense.values()), want - want_dense
    assert extra > 0 and want_extra == pytest.approx(extra, rel=0.03)


def test_estimate_knows_total_and_active(tmp_path, capsys):
    from zerotrain.cli.estimate import main_estimate
    from zerotrain.models import active_param_count

    (tmp_path / "m.yaml").write_text("model: {preset: llama-moe-tiny}\n")
    assert main_estimate(["--model", str(tmp_path / "m.yaml"), "--gpus", "2"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "Ψ = 2,626,688 params (857,216 active per token" in head
    # a model.hf MoE by its config.json: top_k of E experts' tensors count
    torch.manual_seed(0)
    conf = transformers.Qwen3MoeConfig(vocab_size=80, hidden_size=32, intermediate_size=48,
                                       moe_intermediate_size=16, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       num_experts=4, num_experts_per_tok=2, head_dim=8)
    m = transformers.Qwen3MoeForCausalLM(conf)
    m.save_pretrained(tmp_path / "q")
    experts = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in m.parameters())
    cfg = ModelConfig(hf=str(tmp_path / "q"), block_size=24)
    assert active_param_count(cfg) == total - experts // 2


def test_meta_built_moe_initialises_by_name_like_eager():
    """ZeRO-3 materialises a meta-built model unit by unit through plan.init: the experts
    get the eager model's values (N(0, 0.02²), `down` residual-scaled), the router too."""
    from zerotrain.models import plan_for

    cfg = moe_cfg()
    torch.manual_seed(0)
    eager = build_model(cfg)
    torch.manual_seed(0)
    meta = build_model(cfg, device="meta")
    init = plan_for(meta).init
    for name, p in eager.named_parameters():
        t = torch.empty_like(p)
        init(name, t)
        assert torch.equal(t, p), name
    down = eager.blocks[0].mlp.experts.down
    assert abs(down.std().item() - 0.02 / math.sqrt(2 * 2)) < 0.002


def test_moe_keys_are_checked_and_placed():
    """Unknown keys inside model.moe get the usual hint; `moe.` at the top is pointed to
    `model.moe` (the issue's own example wrote `--moe.expert_parallel`)."""
    from zerotrain.config import parse_overrides

    with pytest.raises(ConfigError, match=r"'model\.moe\.expertz' — did you mean "
                                          r"'model\.moe\.experts'"):
        build_config(parse_overrides(["--model.arch", "llama", "--model.moe.expertz", "2"]))
    with pytest.raises(ConfigError, match=r"unknown config key 'moe'.*'model\.moe'"):
        build_config(parse_overrides(["--moe.expert_parallel", "2"]))
