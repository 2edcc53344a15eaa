"""Saved activations of the reference GPT's forward, counted from its ops."""

from __future__ import annotations

from zerotrain.config import ModelConfig

# ----------------------------------------------------------------------------- activations


def block_activation_bytes(b: int, s: int, h: int, a: int, *, mlp_ratio: int = 4,
                           act_bytes: int = 2, stat_bytes: int = 4) -> int:
    """Bytes autograd saves in one reference GPT block (dropout 0), from its ops:

    ln1 input x, ln1 out (for qkv), qkv out (q, k, v are views of it, saved by SDPA),
    SDPA out (also proj's input: a view), x + attn (ln2 input), ln2 out (for fc),
    fc out (for GELU), GELU out (for proj): (8 + 2·mlp_ratio)·b·s·h elements; plus
    mean and rstd of both LayerNorms (4·b·s) and SDPA's logsumexp (a·b·s), both fp32.
    Assumes a memory-efficient SDPA kernel (flash on CPU/CUDA): no s×s matrix is stored.
    """
    bsh = b * s * h
    return (8 + 2 * mlp_ratio) * bsh * act_bytes + (4 * b * s + a * b * s) * stat_bytes


def head_activation_bytes(b: int, s: int, h: int, vocab: int, *, act_bytes: int = 2,
                          stat_bytes: int = 4) -> int:
    """Outside the blocks: ln_f input and output, fp32 log-probs (the loss is fp32 whatever
    the dtype), int64 token ids (embedding, targets) and positions, the loss's weight scalar."""
    return 2 * b * s * h * act_bytes + 2 * b * s * stat_bytes + b * s * vocab * 4 \
        + 8 * (2 * b * s + s) + 4


def activation_bytes(model_cfg: ModelConfig, micro_batch: int, seq: int, *,
                     act_bytes: int = 2, checkpointing: bool | None = None) -> int:
    """Saved activations of a GPT forward at their peak (before backward frees them).

    Checkpointing keeps only each block's input, and recomputes one block at a time in
    backward, which briefly holds that block's full activations again. Dropout > 0 adds
    one 1-byte mask per dropout (CUDA's fused kernel; CPU keeps a full-dtype noise tensor).
    """
    c = model_cfg
    ckpt = c.activation_checkpointing if checkpointing is None else checkpointing
    b, s, h = micro_batch, seq, c.n_embd
    block = block_activation_bytes(b, s, h, c.n_head, mlp_ratio=c.mlp_ratio,
                                   act_bytes=act_bytes)
    if c.dropout > 0:
        block += 2 * b * s * h
    head = head_activation_bytes(b, s, h, c.vocab_size, act_bytes=act_bytes) \
        + (b * s * h if c.dropout > 0 else 0)
    if ckpt:
        inp = b * s * h * act_bytes
        return c.n_layer * inp + (block - inp) + head
    return c.n_layer * block + head


