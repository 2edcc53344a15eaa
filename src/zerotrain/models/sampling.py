"""Sampling text from any causal LM zerotrain builds (its own families or a wrapped HF model).

The model is called on the last `block_size` tokens and must return logits (B, T, V).
`vocab_limit` masks ids the tokenizer cannot decode (a model vocabulary padded past the
tokenizer's, or bytes past 255).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class NonFiniteOutput(ValueError):
    """The model's logits hold NaN or inf: its weights diverged (a user's problem to fix
    with another checkpoint, reported as one line)."""


@torch.no_grad()
def generate(model: nn.Module, idx: Tensor, max_new_tokens: int, block_size: int,
             temperature: float = 0.8, top_k: int | None = 50,
             generator: torch.Generator | None = None,
             vocab_limit: int | None = None) -> Tensor:
    """Append `max_new_tokens` sampled tokens to `idx` (B, T); returns (B, T + new)."""
    for _ in range(max_new_tokens):
        logits = model(idx[:, -block_size:])[:, -1, :].float()
        if not bool(torch.isfinite(logits).all()):
            raise NonFiniteOutput(
                "the model's outputs are not finite (NaN or inf): its weights come from a "
                "run that diverged; sample an earlier checkpoint, or retrain with a lower "
                "optimizer.lr")
        if vocab_limit is not None and vocab_limit < logits.size(-1):
            logits[:, vocab_limit:] = -float("inf")
        logits = logits / max(temperature, 1e-6)
        if top_k:
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float("inf")
        nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def lm_loss(logits: Tensor, targets: Tensor | None) -> Tensor:
    """Logits as they are, or the mean cross-entropy against `targets` — computed in FP32
    whatever the parameter dtype, so mixed-precision runs compare like with like."""
    if targets is None:
        return logits
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


class CausalLM(nn.Module):
    """What every model family zerotrain builds shares: sampling over `cfg.block_size`."""

    cfg: Any
    #: sequence.tile_tokens: the loss computed this many tokens at a time (models/tiling.py)
    tile_tokens: int | None = None

    def head_loss(self, hidden: Tensor, head: nn.Module, targets: Tensor | None) -> Tensor:
        """Logits of the final hidden states, or their loss against `targets` — tiled
        (no full logits) when `tile_tokens` is set."""
        if targets is not None and self.tile_tokens:
            from zerotrain.models.tiling import tiled_lm_loss

            return tiled_lm_loss(hidden, head, targets, self.tile_tokens)
        return lm_loss(head(hidden), targets)

    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 50, generator: torch.Generator | None = None) -> Tensor:
        return generate(self, idx, max_new_tokens, self.cfg.block_size, temperature, top_k,
                        generator)
