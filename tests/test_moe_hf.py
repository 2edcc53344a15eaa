"""Hugging Face MoE checkpoints both ways: `model.hf` reads the per-expert on-disk layout
into transformers' fused experts (through transformers' conversion rules, slice by slice),
and the HF export writes what `from_pretrained` loads back."""

import json

import pytest
import torch
import transformers
from safetensors import safe_open

from zerotrain.config import ModelConfig
from zerotrain.models import build_model, pretrained_weights
from zerotrain.models.hf_export import save_hf

IDX = torch.randint(0, 80, (2, 24), generator=torch.Generator().manual_seed(0))


def moe_folder(tmp_path, kind: str, shard: bool = False):
    """A tiny random HF MoE saved by transformers itself; returns (folder, model)."""
    torch.manual_seed(7)
    common = dict(
        vocab_size=80,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=24,
        num_experts_per_tok=2,
    )
    if kind == "qwen3_moe":
        conf = transformers.Qwen3MoeConfig(
            intermediate_size=48, moe_intermediate_size=16, num_experts=4, head_dim=8, **common
        )
        model = transformers.Qwen3MoeForCausalLM(conf)
    else:
        conf = transformers.MixtralConfig(intermediate_size=16, num_local_experts=4, **common)
        model = transformers.MixtralForCausalLM(conf)
    with torch.no_grad():  # non-trivial norms too, so any misplaced tensor shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path / kind
    model.save_pretrained(folder, max_shard_size="30KB" if shard else "5GB")
    return folder, model.eval()


def stored_names(folder) -> set[str]:
    files = list(folder.glob("*.safetensors"))
    out: set[str] = set()
    for f in files:
        with safe_open(str(f), "pt") as h:
            out |= set(h.keys())
    return out


@pytest.mark.parametrize("kind,shard", [("qwen3_moe", False), ("mixtral", True)])
def test_hf_moe_folder_loads_per_expert_layout(tmp_path, kind, shard):
    folder, ref = moe_folder(tmp_path, kind, shard)
    names = stored_names(folder)
    assert any(".experts.3." in n for n in names)  # per expert on disk ...
    assert not any(n.endswith("gate_up_proj") for n in names)
    cfg = ModelConfig(hf=str(folder), block_size=24)
    model = build_model(cfg)
    weights = pretrained_weights(cfg, model)
    fused = "hf.model.layers.1.mlp.experts.gate_up_proj"  # ... fused in memory
    assert dict(model.named_parameters())[fused].shape == (4, 32, 32)
    weights.load_into(model)
    for n, p in ref.named_parameters():
        assert torch.equal(dict(model.named_parameters())["hf." + n], p), n
    assert torch.equal(model.eval()(IDX), ref(input_ids=IDX).logits)


def test_fused_experts_read_by_slice_only_their_rows(tmp_path):
    """A rank owning a flat range of the fused [E, 2I, H] tensor reads just the stored rows
    that cover it: expert 1's up_proj rows 2..5, not the file."""
    folder, ref = moe_folder(tmp_path, "qwen3_moe")
    cfg = ModelConfig(hf=str(folder), block_size=24)
    model = build_model(cfg, device="meta")
    w = pretrained_weights(cfg, model)
    full = ref.model.layers[0].mlp.experts.gate_up_proj.detach().reshape(-1)
    H = 32
    start = 1 * 32 * H + 16 * H + 2 * H + 5  # expert 1, the up half, row 2, column 5
    stop = start + 3 * H
    got = w.read_slice("hf.model.layers.0.mlp.experts.gate_up_proj", start, stop)
    assert torch.equal(got, full[start:stop])
    assert w.bytes_read == 4 * H * 4  # rows 2..5 of one stored [16, 32] matrix, FP32
    # a range across experts and the gate/up boundary reads from each piece it covers
    a, b = 32 * H - 7, 32 * H + 16 * H + 9
    assert torch.equal(w.read_slice("hf.model.layers.0.mlp.experts.gate_up_proj", a, b), full[a:b])


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_hf_moe_export_round_trips_through_transformers(tmp_path, kind):
    folder, ref = moe_folder(tmp_path, kind)
    cfg = ModelConfig(hf=str(folder), block_size=24)
    model = build_model(cfg)
    pretrained_weights(cfg, model).load_into(model)
    with torch.no_grad():  # trained weights differ from the starting folder
        model.hf.model.layers[1].mlp.experts.down_proj.mul_(1.5)
    out = save_hf(tmp_path / "out", cfg, model.state_dict(), hf_config=model.hf_config)
    assert stored_names(out) == stored_names(folder)  # the Hub's layout, not the fused one
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(ref)
    assert torch.equal(back(input_ids=IDX).logits, model.eval()(IDX))
    assert json.loads((out / "config.json").read_text())["model_type"] == kind


def test_hf_moe_adds_its_balancing_loss_when_its_config_asks(tmp_path):
    """output_router_logits in config.json: training adds router_aux_loss_coef times
    transformers' own aux_loss; evaluation reports the LM loss alone."""
    folder, ref = moe_folder(tmp_path, "qwen3_moe")
    conf = json.loads((folder / "config.json").read_text())
    conf.update(output_router_logits=True, router_aux_loss_coef=0.5)
    (folder / "config.json").write_text(json.dumps(conf))
    cfg = ModelConfig(hf=str(folder), block_size=24)
    model = build_model(cfg)
    pretrained_weights(cfg, model).load_into(model)
    tgt = torch.roll(IDX, -1, 1)
    train, plain = model.train()(IDX, tgt).item(), model.eval()(IDX, tgt).item()
    ref.config.output_router_logits = True
    aux = ref(input_ids=IDX).aux_loss.item()
    assert aux > 0 and abs(train - plain - 0.5 * aux) < 1e-6
