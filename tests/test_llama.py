"""The llama family against Hugging Face's LlamaForCausalLM (same config, same weights),
presets and parameter counts against the built model, and config resolution errors."""

import pytest
import torch
import torch.nn.functional as F
import transformers

from zerotrain.config import ConfigError, ModelConfig, build_config
from zerotrain.models import PRESETS, build_model, count_params, plan_for, resolve_model_config
from zerotrain.models.hf_export import hf_name, to_hf
from zerotrain.models.llama import Llama
from zerotrain.models.plan import Group


def tiny(**kw) -> ModelConfig:
    base = dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=96,
                block_size=32, rope_theta=500000.0, norm_eps=1e-6)
    return ModelConfig(**{**base, **kw})


def hf_twin(model: Llama):
    """An HF LlamaForCausalLM with the same config and a copy of the same weights."""
    config, sd = to_hf(model.cfg, model.state_dict())
    conf = transformers.LlamaConfig(**{k: v for k, v in config.items()
                                       if k not in ("architectures", "model_type")})
    twin = transformers.LlamaForCausalLM(conf).float().eval()
    missing, unexpected = twin.load_state_dict(sd, strict=False)
    assert not unexpected
    assert missing == (["lm_head.weight"] if model.cfg.tie_weights else [])
    return twin


@pytest.mark.parametrize("kw", [{}, {"tie_weights": True}, {"bias": True, "n_kv_head": 4},
                                {"n_kv_head": 1, "intermediate_size": 100}])
def test_matches_hf_llama_forward_and_backward(kw):
    torch.manual_seed(0)
    model = Llama(tiny(**kw)).eval()
    if kw.get("bias"):  # zero-initialised biases would not test their mapping
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("bias"):
                    p.normal_(0, 0.1)
    twin = hf_twin(model)
    idx = torch.randint(0, 96, (3, 32))
    targets = torch.randint(0, 96, (3, 32))
    logits = model(idx)
    ref = twin(input_ids=idx, use_cache=False).logits
    assert (logits - ref).abs().max().item() <= 1e-5
    loss = model(idx, targets)
    ref_loss = F.cross_entropy(ref.view(-1, 96), targets.view(-1))
    assert abs(loss.item() - ref_loss.item()) <= 1e-6
    loss.backward()
    ref_loss.backward()
    hf_params = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        g = hf_params[hf_name("llama", name)[0]].grad
        assert torch.allclose(p.grad, g, rtol=1e-4, atol=1e-6), name


def test_activation_checkpointing_same_gradients():
    torch.manual_seed(1)
    a = Llama(tiny())
    b = Llama(tiny(activation_checkpointing=True))
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 96, (2, 16))
    for m in (a, b):
        m(idx, idx).backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-7), n


def test_generate_is_reproducible_and_respects_context():
    torch.manual_seed(2)
    m = Llama(tiny(block_size=8)).eval()
    prompt = torch.randint(0, 96, (1, 5))
    a = m.generate(prompt, 12, generator=torch.Generator().manual_seed(7))
    b = m.generate(prompt, 12, generator=torch.Generator().manual_seed(7))
    assert a.shape == (1, 17) and torch.equal(a, b) and torch.equal(a[:, :5], prompt)


def test_plan_groups_and_units():
    m = Llama(tiny())
    p = plan_for(m)
    assert p.blocks == tuple(m.blocks)
    assert p.group_of("embed.weight") == p.group_of("head.weight") == Group.EMBEDDING
    assert p.group_of("blocks.0.attn.q.weight") == Group.MATRIX
    assert p.group_of("blocks.1.mlp_norm.weight") == Group.VECTOR
    assert "blocks.0.mlp.down" in p.fp8_linears and "head" not in p.fp8_linears


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_param_counts_match_built_model(name):
    family = PRESETS[name][0]
    cfg = ModelConfig(preset=name, vocab_size=50304 if family == "gpt" else 32000)
    model = build_model(cfg, device="meta")
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)


def test_presets_fill_only_unset_fields_and_family_defaults():
    c = resolve_model_config(build_config({"model": {"preset": "llama-60m", "n_layer": 2}}).model)
    assert (c.arch, c.n_layer, c.n_embd, c.intermediate_size) == ("llama", 2, 512, 1376)
    assert c.bias is False and c.tie_weights is False and c.n_kv_head == 8
    assert resolve_model_config(c) == c  # idempotent
    g = ModelConfig()  # today's default GPT is unchanged
    assert (g.arch, g.n_layer, g.n_embd, g.bias, g.tie_weights, g.vocab_size) == \
        ("gpt", 4, 128, True, True, 256)
    assert ModelConfig(arch="llama", n_embd=768).intermediate_size == 2048


def test_preset_and_family_errors():
    with pytest.raises(ConfigError, match="did you mean 'llama-60m'"):
        resolve_model_config(ModelConfig(preset="llama-60"))
    with pytest.raises(ConfigError, match=r"is a llama size but model\.arch is gpt"):
        resolve_model_config(ModelConfig(preset="llama-tiny", arch="gpt"))
    with pytest.raises(ConfigError, match=r"multiple of model\.n_kv_head"):
        build_config({"model": {"arch": "llama", "n_head": 4, "n_kv_head": 3}})
    with pytest.raises(ConfigError, match=r"gpt does not use model\.n_kv_head"):
        build_config({"model": {"n_kv_head": 2}})


def test_vocab_follows_tokenizer_unless_set():
    assert resolve_model_config(ModelConfig(), tokenizer_vocab=4096).vocab_size == 4096
    assert resolve_model_config(ModelConfig(vocab_size=4160), tokenizer_vocab=4096
                                ).vocab_size == 4160  # padded: allowed
    with pytest.raises(ConfigError, match="smaller than the tokenizer's 4096"):
        resolve_model_config(ModelConfig(vocab_size=256), tokenizer_vocab=4096)


def test_shipped_llama_bpe_config_resolves():
    from pathlib import Path

    from zerotrain.config import load_config

    cfg = load_config(Path(__file__).parents[1] / "configs" / "llama-bpe.yaml")
    assert cfg.data.tokenizer == "bpe:4096"
    m = resolve_model_config(cfg.model, tokenizer_vocab=4096)
    assert (m.arch, m.n_layer, m.n_embd, m.n_kv_head, m.vocab_size) == ("llama", 4, 128, 2, 4096)
    assert count_params(m) == 4 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384 + 256) \
        + 128 + 2 * 4096 * 128  # blocks + final norm + embedding and untied head
