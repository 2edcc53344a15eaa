"""The reference GPT: a small, standard pre-norm decoder.

token + position embedding -> n_layer x [LN -> causal self-attention -> +, LN -> MLP -> +]
-> LN -> linear head (optionally tied to the token embedding). Attention uses
`scaled_dot_product_attention`. The loss is computed in FP32 whatever the parameter
dtype, so mixed-precision runs compare like with like.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zerotrain.config import ModelConfig
from zerotrain.models.checkpointing import apply_checkpointing
from zerotrain.models.documents import document_positions
from zerotrain.models.init import deferred_init, init_decoder_param
from zerotrain.models.plan import Plan, plan_from
from zerotrain.models.sampling import CausalLM
from zerotrain.models.ulysses import position_offset, ulysses_attention


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # over the whole sequence with sequence parallelism (models/ulysses.py)
        y = ulysses_attention(q, k, v, self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    position_wise = True  # each token's output depends on that token only: tiling may cut it

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(CausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        with deferred_init(self, self.init_param):  # values: models/init.py
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
            self.drop = nn.Dropout(cfg.dropout)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
            self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
            if cfg.tie_weights:
                self.head.weight = self.wte.weight
        apply_checkpointing(self.blocks, cfg.activation_checkpointing)

    def init_param(self, name: str, t: Tensor) -> None:
        """Parameter `name`'s initial value, from (seed, name) alone (models/init.py), so a
        model materialised unit by unit on the meta device equals the eager one. GPT-2's
        scaled init of residual projections keeps the residual stream's variance flat."""
        init_decoder_param(self, name, t, self.init_seed, ("proj.weight",), self.cfg.n_layer)

    def num_params(self, exclude_position: bool = False) -> int:
        """Unique parameters: a tied head and embedding count once."""
        n = sum(p.numel() for p in self.parameters())  # parameters() already de-duplicates
        return n - self.wpe.weight.numel() if exclude_position else n

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        """Logits (B, T, V), or the mean FP32 cross-entropy when targets are given."""
        T = idx.shape[1]
        start = position_offset()  # global positions: this rank's slice under SP
        if self.cfg.block_size < start + T:
            raise ValueError(f"sequence length {start + T} exceeds model.block_size "
                             f"{self.cfg.block_size}")
        # in-document positions with packed documents (models/documents.py)
        pos = document_positions(start, T)
        if pos is None:
            pos = torch.arange(start, start + T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:  # checkpointed per model.activation_checkpointing
            x = block(x)
        return self.head_loss(self.ln_f(x), self.head, targets)



def plan(model: GPT) -> Plan:
    """The GPT's blocks are its ZeRO-3 units; wte, wpe and the (tied) head its edge."""
    return plan_from(model, list(model.blocks), [model.wte, model.wpe, model.head],
                     init=model.init_param)
