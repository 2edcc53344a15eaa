"""Expert parallelism for Hugging Face MoE models: transformers' experts modules
(`@use_experts_implementation`: Qwen3-MoE, Mixtral, ... — fused `gate_up_proj`
[E, 2I, d] and `down_proj` [E, d, I], called as `experts(hidden, top_k_index,
top_k_weights)`) are swapped at build time for `ParallelHFExperts`, which holds this
rank's E/P experts under the same names and sends each (token, expert) pair to its
expert's rank and back (models/moe_parallel.py) — the user's model code is not edited.

Supported: the concatenated, untransposed, bias-free gated layout (Qwen3-MoE, Mixtral,
Qwen2-MoE's routed experts, OLMoE, ...). Others (gpt-oss's interleaved, transposed
experts with biases) are refused by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zerotrain.config.base import ConfigError
from zerotrain.models.moe_parallel import dispatch, ep_slot


def is_hf_experts(m: nn.Module) -> bool:
    """A transformers experts module (its class went through use_experts_implementation)."""
    return (hasattr(m, "is_concatenated") and hasattr(m, "num_experts")
            and isinstance(getattr(m, "gate_up_proj", None), nn.Parameter))


class ParallelHFExperts(nn.Module):
    """This rank's E/P experts of one transformers experts module, same parameter names."""

    def __init__(self, original: nn.Module, parallel: int):
        super().__init__()
        E = original.num_experts
        local = E // parallel
        self.total, self.expert_parallel = E, parallel
        self.first = ep_slot(parallel) * local
        self.act_fn = original.act_fn
        self.init_std = float(getattr(original.config, "initializer_range", 0.02))
        dev = original.gate_up_proj.device
        self.gate_up_proj = nn.Parameter(torch.empty(
            local, *original.gate_up_proj.shape[1:], device=dev))
        self.down_proj = nn.Parameter(torch.empty(
            local, *original.down_proj.shape[1:], device=dev))
        if dev.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Random experts (a model.hf folder without weights): N(0, initializer_range²)."""
        with torch.no_grad():
            for p in (self.gate_up_proj, self.down_proj):
                p.normal_(0.0, self.init_std)

    def local(self, xs: Tensor, counts: list[int]) -> Tensor:
        outs, a = [], 0
        for e, c in enumerate(counts):  # every local expert, an empty one too
            gate, up = F.linear(xs[a:a + c], self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
            a += c
        return torch.cat(outs)

    def forward(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        k = top_k_index.shape[-1]
        expert = top_k_index.reshape(-1)
        token = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(k)
        weight = top_k_weights.reshape(-1)
        order = torch.argsort(expert, stable=True)
        expert, token, weight = expert[order], token[order], weight[order]
        counts = torch.bincount(expert, minlength=self.total)
        ys = dispatch(self, hidden[token], counts, compute=self.local)
        ys = ys * weight[:, None].to(ys.dtype)
        return torch.zeros_like(hidden).index_add_(0, token, ys.to(hidden.dtype))


def swap_hf_experts(model: nn.Module, parallel: int) -> int:
    """Replace every transformers experts module of `model` by its expert-parallel twin;
    how many were replaced. One ConfigError naming the field when it cannot be."""
    found = [(name, m) for name, m in model.named_modules() if is_hf_experts(m)]
    if not found:
        raise ConfigError(f"model.moe.expert_parallel {parallel}: model.hf is not a mixture "
                          "of experts (no transformers experts module): remove model.moe")
    for name, m in found:
        if m.num_experts % parallel:
            raise ConfigError(f"model.moe.expert_parallel ({parallel}) must divide the "
                              f"model.hf experts ({m.num_experts}, config.json)")
        odd = [f for f, bad in (("transposed", m.is_transposed), ("bias", m.has_bias),
                                ("interleaved", not m.is_concatenated),
                                ("no gate", not m.has_gate),
                                ("post-expert norm", getattr(m, "has_post_expert_norm",
                                                             False))) if bad]
        if odd:
            raise ConfigError(f"model.moe.expert_parallel: {type(m).__name__}'s experts are "
                              f"{', '.join(odd)}; expert parallelism supports the fused "
                              "gate_up_proj/down_proj layout (Qwen3-MoE, Mixtral): set "
                              "model.moe.expert_parallel 1")
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf,
                ParallelHFExperts(m, parallel))
    return len(found)


__all__ = ["ParallelHFExperts", "is_hf_experts", "swap_hf_experts"]
