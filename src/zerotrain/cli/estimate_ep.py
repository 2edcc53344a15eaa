"""`zerotrain estimate --model` of a MoE with expert parallelism: the whole model's
size, and the shape the expert-parallel section is computed from (memory/experts.py)."""

from __future__ import annotations

from zerotrain.config import ModelConfig
from zerotrain.memory.experts import ExpertShape
from zerotrain.models.presets import resolve_model_config


def whole_model(mc: ModelConfig) -> ModelConfig:
    """The config with every expert on one rank (EP 1): what Ψ counts."""
    if mc.moe is None or mc.moe.expert_parallel == 1:
        return mc
    return mc.model_copy(update={"moe": mc.moe.model_copy(update={"expert_parallel": 1})})


def expert_shape(mc: ModelConfig, psi: int) -> ExpertShape | None:
    """The expert-parallel shape of a native MoE config (None without EP)."""
    c = resolve_model_config(mc)
    if c.moe is None or c.moe.expert_parallel == 1:
        return None
    if c.hf is not None:
        return _hf_shape(c, psi)
    assert c.n_embd and c.n_layer and c.intermediate_size
    per_layer = c.moe.experts * 3 * c.n_embd * c.intermediate_size
    return ExpertShape(psi, per_layer * c.n_layer, c.n_layer, c.moe.experts, c.moe.top_k,
                       c.n_embd, c.moe.expert_parallel, 0)


def _hf_shape(c: ModelConfig, psi: int) -> ExpertShape:
    """A model.hf MoE's shape: its experts modules counted on the meta device (EP 1)."""
    from zerotrain.memory.activations import moe_shape
    from zerotrain.models import build_model, hf
    from zerotrain.models.hf_experts import is_hf_experts

    raw = hf.read_hf_config(c.hf)
    experts, top_k, _ = moe_shape(raw)
    model = build_model(whole_model(c), device="meta")
    mods = [m for m in model.modules() if is_hf_experts(m)]
    numel = sum(p.numel() for m in mods for p in m.parameters())
    return ExpertShape(psi, numel, len(mods), experts, top_k, int(raw["hidden_size"]),
                       c.moe.expert_parallel, 0)
