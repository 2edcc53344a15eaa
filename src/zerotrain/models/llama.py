"""A Llama-family decoder: what changed in decoders after GPT-2, in one small file.

token embedding -> n_layer x [RMSNorm -> grouped-query attention with rotary positions -> +,
RMSNorm -> SwiGLU MLP -> +] -> RMSNorm -> linear head (untied by default). No biases,
no learned positions. The layout follows Hugging Face's `LlamaForCausalLM` (rotary on
the two halves of each head, not interleaved pairs) so export is a renaming, no
permutation. As in the GPT, the loss is computed in FP32 whatever the parameter dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zerotrain.config import ConfigError, ModelConfig
from zerotrain.models.checkpointing import apply_checkpointing
from zerotrain.models.documents import document_positions
from zerotrain.models.init import deferred_init, fill_normal, generator_for, init_decoder_param
from zerotrain.models.moe import MoE, router_loss
from zerotrain.models.plan import Plan, plan_from
from zerotrain.models.presets import resolve_model_config
from zerotrain.models.sampling import CausalLM
from zerotrain.models.ulysses import position_offset, ulysses_attention


class RMSNorm(nn.Module):
    """x / rms(x) * gain. No mean subtraction, no bias; computed in FP32 because a mean
    of squares overflows/underflows in 16-bit formats."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(T: int, head_dim: int, theta: float, device: torch.device, start: int = 0,
                positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (T, head_dim) for positions start .. start + T - 1: position t
    turns channel pair (i, i + head_dim/2) by t / theta^(2i/head_dim). Recomputed per
    forward (cheap), so no buffer needs care on the meta device or in checkpoints.
    Given per-token `positions` [B, T] (packed documents), shape (B, 1, T, head_dim)."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / theta ** exps
    if positions is not None:
        angles = (positions.float()[..., None] * inv_freq).unsqueeze(1)
    else:
        angles = torch.outer(torch.arange(start, start + T, device=device).float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, H, T, hd) queries or keys by their position: a rotation, so q·k depends
    only on the distance between the two positions."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention: n_head query heads share n_kv_head key/value heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.n_embd and cfg.n_head and cfg.n_kv_head
        self.n_head, self.n_kv = cfg.n_head, cfg.n_kv_head
        self.hd = cfg.n_embd // cfg.n_head
        d, b = cfg.n_embd, bool(cfg.bias)
        self.q = nn.Linear(d, self.n_head * self.hd, bias=b)
        self.k = nn.Linear(d, self.n_kv * self.hd, bias=b)
        self.v = nn.Linear(d, self.n_kv * self.hd, bias=b)
        self.o = nn.Linear(self.n_head * self.hd, d, bias=b)
        self.dropout = cfg.dropout

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_head, self.hd).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # query head h reads key/value head h // group; over the whole sequence with
        # sequence parallelism (models/ulysses.py)
        y = ulysses_attention(q, k, v, self.dropout if self.training else 0.0)
        return self.o(y.transpose(1, 2).reshape(B, T, self.n_head * self.hd))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): a gated MLP, three matrices instead of two."""

    position_wise = True  # each token's output depends on that token only: tiling may cut it

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.n_embd and cfg.intermediate_size
        d, h, b = cfg.n_embd, cfg.intermediate_size, bool(cfg.bias)
        self.gate = nn.Linear(d, h, bias=b)
        self.up = nn.Linear(d, h, bias=b)
        self.down = nn.Linear(h, d, bias=b)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.n_embd
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp: nn.Module = MoE(cfg) if cfg.moe is not None else SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class Llama(CausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg = resolve_model_config(cfg)
        if cfg.arch != "llama":
            raise ConfigError(f"Llama needs model.arch llama, got {cfg.arch}")
        assert cfg.n_embd and cfg.n_layer and cfg.n_head
        self.cfg = cfg
        with deferred_init(self, self.init_param):  # values: models/init.py
            self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.drop = nn.Dropout(cfg.dropout)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
            self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
            if cfg.tie_weights:
                self.head.weight = self.embed.weight
        apply_checkpointing(self.blocks, cfg.activation_checkpointing)

    def init_param(self, name: str, t: Tensor) -> None:
        """As the GPT's (models/init.py): a function of (seed, name) alone; residual
        projections scaled so the residual stream's variance stays flat."""
        assert self.cfg.n_layer
        if ".mlp.experts." in name:  # fused experts: each a SwiGLU, `down` residual-scaled
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("down") else 0.02
            experts = self.get_submodule(name.rpartition(".")[0])
            if experts.total == t.shape[0]:
                fill_normal(t, std, generator_for(self.init_seed, name))
            else:  # expert parallelism: this rank's experts of the whole layer's draw
                full = torch.empty((experts.total, *t.shape[1:]), dtype=torch.float32)
                fill_normal(full, std, generator_for(self.init_seed, name))
                with torch.no_grad():
                    t.copy_(full[experts.first:experts.first + t.shape[0]])
            return
        init_decoder_param(self, name, t, self.init_seed, ("attn.o.weight", "mlp.down.weight"),
                           self.cfg.n_layer)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        """Logits (B, T, V), or the mean FP32 cross-entropy when targets are given."""
        T = idx.shape[1]
        start = position_offset()  # global positions: this rank's slice under SP
        if self.cfg.block_size < start + T:
            raise ValueError(f"sequence length {start + T} exceeds model.block_size "
                             f"{self.cfg.block_size}")
        assert self.cfg.n_embd and self.cfg.n_head
        cos, sin = rope_tables(T, self.cfg.n_embd // self.cfg.n_head, self.cfg.rope_theta,
                               idx.device, start, document_positions(start, T))
        x = self.drop(self.embed(idx))
        for block in self.blocks:  # checkpointed per model.activation_checkpointing
            x = block(x, cos, sin)
        loss = self.head_loss(self.norm(x), self.head, targets)
        aux = router_loss(self) if self.cfg.moe is not None else None
        # the router's losses train the routers; evaluation reports the LM loss alone
        return loss + aux if targets is not None and aux is not None else loss


def plan(model: Llama) -> Plan:
    """The blocks are the ZeRO-3 units; the embedding and the (untied) head are the edge."""
    return plan_from(model, list(model.blocks), [model.embed, model.head],
                     init=model.init_param)
