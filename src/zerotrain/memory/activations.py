"""Activations of a training step, per rank, counted from the ops of each model family.

Two numbers matter: what autograd *saves* in forward (held until backward frees it), and
the step's *peak*, which adds the transients of backward at its widest moment. Both are
counted for the reference GPT, llama and Hugging Face causal LMs (llama-style ones by the
llama count, GPT-2-style ones by the GPT count), with `model.activation_checkpointing`
off, on or `offload`, and with sequence tiling (`sequence.tile_tokens`).

n = micro_batch × seq tokens, h the width, I the MLP width, V the vocabulary, ab the
activation dtype's bytes (the engine casts the model: every activation has it); norm
statistics, attention's log-sum-exp and the loss are fp32.

- **blocks**: `gpt_block_saved` / `llama_block_saved` (each term named in its docstring).
  A tiled MLP saves only its input (already saved for the block's norm), not its
  `[n × I]` intermediates.
- **head**: the final norm, and untiled the fp32 log-softmax `[n × V]`; at backward's
  start its gradient and the logits' gradient join it (3·n·V·4 at once — the largest
  transient of a long-sequence step). Tiled: one tile's logits and softmax (2·N·V·4),
  the hidden states' gradient (n·h) and the head weight's accumulated gradient (V·h,
  summed in fp32: below fp32 the sum and one tile's product, V·h·(4 + bytes)).
- **checkpointing**: every block keeps only its input (n·h), and backward recomputes one
  block at a time: that block's saved activations plus its gradients in flight.
  `offload` moves the kept inputs to pinned host memory (`host`); on CUDA at most two are
  on the device at once (the one recomputing, the one coming back). On a CPU the host
  is the device: offload counts as checkpointing.
- **sequence parallelism** (`sequence.parallel` S): every per-token tensor holds this
  rank's T/S tokens — blocks, head, tiles, tables; attention's head-sharded q, k, v and
  output over all T tokens with H/S heads are the same size. The exchanges add their
  buffers (`exchange_bytes`, `EXCHANGE_COPIES`): beside attention's backward, and with
  checkpointing beside the recomputed block.
- **document masking** (`data.document_mask`): one additive [b, 1, T, T] mask in the
  activation dtype for the whole sequence — every rank builds it whole, sequence
  parallelism does not divide it — held from the forward's start to the backward's end
  (shared by the layers), plus each token's document id and position (int64); while it
  is built a boolean [b, T, T] joins it. O(T²): 64 MiB per fp32 sequence at T = 4,096,
  4 GiB at 32,768 (measured to the byte on CPU SDPA, tests/test_document_mask.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerotrain.config import ModelConfig

STAT = 4  # fp32 statistics, log-sum-exp, loss
#: Ulysses exchange buffers at the step's peak, in packed-q/k/v sizes (`exchange_bytes`),
#: per family: (no checkpointing: on top of everything saved, in the last block's
#: attention backward; checkpointing: beside one block's recompute and backward).
#: `_exchange` stacks a copy to send, receives one and concatenates a third while the
#: input lives; how many of these overlap autograd's own buffers was measured (CPU SDPA,
#: S = 2, fp32, min of 3 steps; tests/test_sequence_parallel.py holds it within 10%).
EXCHANGE_COPIES = {"gpt": (2.5, 1.5), "llama": (2.0, 1.75)}


# ----------------------------------------------------------------------------- blocks


def block_activation_bytes(b: int, s: int, h: int, a: int, *, mlp_ratio: int = 4,
                           act_bytes: int = 2, stat_bytes: int = 4) -> int:
    """Bytes autograd saves in one reference GPT block (dropout 0), from its ops:

    ln1 input x, ln1 out (for qkv), qkv out (q, k, v are views of it, saved by SDPA),
    SDPA out (also proj's input: a view), x + attn (ln2 input), ln2 out (for fc),
    fc out (for GELU), GELU out (for proj): (8 + 2·mlp_ratio)·b·s·h elements; plus
    mean and rstd of both LayerNorms (4·b·s) and SDPA's logsumexp (a·b·s), both fp32.
    Assumes a memory-efficient SDPA kernel (flash on CPU/CUDA): no s×s matrix is stored.
    """
    return gpt_block_saved(b * s, h, a, mlp_ratio * h, act_bytes, stat_bytes=stat_bytes)


def gpt_block_saved(n: int, h: int, a: int, inter: int, ab: int, *, tiled_mlp: bool = False,
                    stat_bytes: int = STAT) -> int:
    """The GPT block's saved bytes (`block_activation_bytes`); a tiled MLP drops its two
    `[n × I]` tensors (fc out, GELU out)."""
    mlp = 0 if tiled_mlp else 2 * n * inter
    return (8 * n * h + mlp) * ab + (4 * n + a * n) * stat_bytes


def llama_block_saved(n: int, h: int, a: int, inter: int, ab: int, *,
                      tiled_mlp: bool = False) -> int:
    """Bytes one llama block saves (counted op by op, held to the saved tensors in the
    tests). Each RMSNorm: its input in fp32 (the input itself when fp32, else an fp32
    copy), rstd (n fp32), the normalised fp32·→ab product and the gained output (2·n·h·ab).
    Attention: rotated q and k and v (GQA's repeated k, v are n·h each, like full heads;
    rotary multiplies by tables that need no gradient, so the unrotated q, k are not
    kept), SDPA's output (also the o projection's input) and log-sum-exp (a·n fp32).
    SwiGLU: gate out, SiLU out, up out and their product (4·n·I), none when tiled.
    """
    norm = n * h * STAT + n * STAT + 2 * n * h * ab
    attn = 4 * n * h * ab + a * n * STAT
    mlp = 0 if tiled_mlp else 4 * n * inter * ab
    return 2 * norm + attn + mlp


# ----------------------------------------------------------------------------- head


def head_activation_bytes(b: int, s: int, h: int, vocab: int, *, act_bytes: int = 2,
                          stat_bytes: int = 4) -> int:
    """Outside the GPT's blocks: ln_f input and output, fp32 log-probs (the loss is fp32
    whatever the dtype), int64 token ids (embedding, targets) and positions, the loss's
    weight scalar."""
    return 2 * b * s * h * act_bytes + 2 * b * s * stat_bytes + b * s * vocab * 4 \
        + 8 * (2 * b * s + s) + 4


@dataclass
class Activations:
    """Bytes per rank: `saved` at the end of forward, the step's `peak` on the device
    (saved + backward's widest transient), `host` (offloaded block inputs)."""

    saved: int
    peak: int
    host: int = 0


@dataclass
class _Shape:
    family: str  # "gpt" | "llama"
    n_layer: int
    h: int
    heads: int
    inter: int
    vocab: int
    kv: int = 0  # KV heads (0: as many as query heads)
    experts: int = 0  # a MoE's experts per layer (0: a dense MLP)
    top_k: int = 1  # experts per token: `inter` is then top_k x one expert's width


def moe_shape(raw: dict[str, Any]) -> tuple[int, int, int | None]:
    """(experts, top_k, expert width) of a Hugging Face MoE config.json; (0, 1, None)
    for a dense one. transformers' names: Mixtral's num_local_experts, Qwen-MoE's
    num_experts and moe_intermediate_size."""
    experts = raw.get("num_local_experts") or raw.get("num_experts") or 0
    if not experts or not raw.get("num_experts_per_tok"):
        return 0, 1, None
    width = raw.get("moe_intermediate_size") or raw.get("intermediate_size")
    return int(experts), int(raw["num_experts_per_tok"]), width


def moe_block_extra(sh: _Shape, n: int, ab: int) -> int:
    """What a MoE layer saves beyond a SwiGLU of width top_k·I (models/moe.py): the
    tokens dispatched to their experts, the experts' outputs and their weighted copies
    (3 [k·n x h]); the router's fp32 probabilities (the routing's and the balancing
    loss's) and logits (the z-loss's) [n x E] each; the top-k weights and their
    renormalised copy (2 [n x k] fp32); the int64 indices of the sort, gather and
    scatter (5 [k·n]). Held to the saved tensors in tests/test_moe.py (within 2%)."""
    if not sh.experts:
        return 0
    kn = sh.top_k * n
    return 3 * kn * sh.h * ab + 3 * n * sh.experts * STAT + 2 * kn * STAT + 5 * kn * 8


def _shape(c: ModelConfig, hf_config: dict[str, Any] | None = None) -> _Shape:
    """The sizes that set activations; a Hugging Face config by its own fields."""
    if c.hf is not None or hf_config is not None:
        if hf_config is None:
            from zerotrain.config.model import read_hf_config

            hf_config = read_hf_config(c.hf)  # type: ignore[arg-type]
        raw = hf_config
        h = raw.get("hidden_size") or raw.get("n_embd") or c.n_embd
        gpt2 = raw.get("model_type") == "gpt2" or "n_inner" in raw
        inter = (raw.get("n_inner") or 4 * h) if gpt2 else raw.get("intermediate_size")
        experts, k, width = moe_shape(raw)
        return _Shape("gpt" if gpt2 else "llama",
                      raw.get("num_hidden_layers") or raw.get("n_layer") or c.n_layer,
                      h, raw.get("num_attention_heads") or raw.get("n_head") or c.n_head,
                      k * (width or inter or 4 * h), raw.get("vocab_size") or c.vocab_size,
                      0 if gpt2 else raw.get("num_key_value_heads") or 0, experts, k)
    assert c.n_layer and c.n_embd and c.n_head
    inter = c.intermediate_size or c.mlp_ratio * c.n_embd
    kv = (c.n_kv_head or 0) if c.arch == "llama" else 0
    experts, k = (c.moe.experts, c.moe.top_k) if c.moe is not None else (0, 1)
    return _Shape(c.arch or "gpt", c.n_layer, c.n_embd, c.n_head, k * inter, c.vocab_size,
                  kv, experts, k)


def exchange_bytes(sh: _Shape, n_local: int, sp: int, ab: int) -> int:
    """Bytes of one Ulysses exchange's packed q, k, v on a rank holding `n_local` tokens:
    [H + 2·Hkv'] heads × D × n_local, Hkv' the KV heads after the fewest copies that
    split them over `sp` ranks (`models/ulysses.py`); the output's exchange is smaller."""
    heads, kv = sh.heads, sh.kv or sh.heads
    group = heads // kv
    r = next((r for r in range(1, group + 1) if group % r == 0 and (kv * r) % sp == 0), 1)
    return n_local * (sh.h + 2 * kv * r * (sh.h // heads)) * ab


def activation_parts(model_cfg: ModelConfig, micro_batch: int, seq: int, *,
                     act_bytes: int = 2, checkpointing: bool | str | None = None,
                     tile_tokens: int | None = None, device: str = "cuda",
                     hf_config: dict[str, Any] | None = None,
                     sequence_parallel: int = 1, document_mask: bool = False) -> Activations:
    """Saved, peak and host activation bytes of one rank's training step (module doc)."""
    parts = _parts(model_cfg, micro_batch, seq, act_bytes, checkpointing, tile_tokens,
                   device, hf_config, sequence_parallel)
    if not document_mask:
        return parts
    mask = micro_batch * seq * seq * act_bytes  # the whole sequence's, on every rank
    held = mask + 2 * 8 * micro_batch * seq  # + document ids and positions
    return Activations(parts.saved + held, max(parts.peak + held,
                                               mask + micro_batch * seq * seq), parts.host)


def _parts(model_cfg: ModelConfig, micro_batch: int, seq: int, act_bytes: int,
           checkpointing: bool | str | None, tile_tokens: int | None, device: str,
           hf_config: dict[str, Any] | None, sequence_parallel: int) -> Activations:
    c = model_cfg
    sh = _shape(c, hf_config)
    mode = c.activation_checkpointing if checkpointing is None else checkpointing
    offload = mode == "offload" and device == "cuda"
    S = max(1, sequence_parallel)
    # with sequence parallelism every per-token tensor holds this rank's T/S tokens
    n, h, ab, V, L = micro_batch * seq // S, sh.h, act_bytes, sh.vocab, sh.n_layer
    seq //= S
    tiled_head = tile_tokens is not None  # the tiled loss, even as one tile
    # the MLP runs plain when one tile holds it all, and a MoE is never tiled
    tiled = tiled_head and tile_tokens < n and not sh.experts
    tile = min(tile_tokens, n) if tile_tokens is not None else n
    if sh.family == "gpt":
        block = gpt_block_saved(n, h, sh.heads, sh.inter, ab, tiled_mlp=tiled)
        norm = 2 * n * h * ab + 2 * n * STAT  # ln_f input, output, mean/rstd
        tables = 8 * seq  # positions
    else:
        block = llama_block_saved(n, h, sh.heads, sh.inter, ab, tiled_mlp=tiled) \
            + moe_block_extra(sh, n, ab)
        norm = n * h * STAT + n * STAT + 2 * n * h * ab  # as a block's RMSNorm
        tables = 2 * seq * (h // sh.heads) * STAT  # rotary cos, sin
    if c.dropout > 0:  # a mask per dropout (CUDA: 1 byte; CPU keeps a full-dtype noise)
        block += 2 * n * h
        norm += n * h
    ids = 8 * 2 * n + 4  # token ids, targets, the loss
    head_saved = norm + ids + (0 if tiled_head else n * V * STAT)
    # tiles sum parameter gradients in fp32: below fp32, the fp32 sum and one tile's
    # product (or the final cast) coexist (models/tiling.py)
    acc = STAT + ab if ab < STAT else ab
    if tiled_head:  # one tile's logits + softmax, grad of the hidden states, head weight grad
        head_peak = 2 * tile * V * STAT + n * h * ab + V * h * acc
    else:  # log-softmax, its gradient, the logits' gradient
        head_peak = 2 * n * V * STAT
    # one block's backward (what joins its saved activations, freed as it goes): in the
    # MLP the residual gradients in and out and the widest [tokens × I] gradient pair;
    # in attention the gradients of the output, q, k, v and the residual (GPT: and the
    # fused qkv's concatenated gradient) — measured on SDPA's flash backward
    mlp_grad = 2 * n * h * ab + 2 * (n if sh.experts else tile) * sh.inter * ab
    if tiled:  # the tiled MLP's parameter gradients: the running sum and one tile's
        mlp_grad += (2 if sh.family == "gpt" else 3) * h * sh.inter * max(acc, 2 * ab)
    attn_grad = (5 if sh.family == "gpt" else 3) * n * h * ab
    # sequence parallelism: the exchanges' buffers join attention (`EXCHANGE_COPIES`)
    plain_a2a, ckpt_a2a = (int(k * exchange_bytes(sh, n, S, ab)) if S > 1 else 0
                           for k in EXCHANGE_COPIES[sh.family])
    block_bwd = max(mlp_grad, attn_grad + ckpt_a2a)
    inp = n * h * ab
    if mode:
        kept = (0 if offload else L * inp)
        on_device = min(2, L) * inp if offload else 0
        saved = kept + on_device + head_saved + tables
        # a tied head's gradient waits in autograd for the embedding's, to be summed
        tied = V * h * ab if tiled_head and c.hf is None and hf_config is None \
            and c.tie_weights else 0
        peak = max(saved + head_peak,
                   kept + on_device + tables + block + block_bwd + tied)
        return Activations(saved, peak, L * inp if offload else 0)
    saved = L * block + head_saved + tables
    return Activations(saved, saved + max(head_peak, plain_a2a))


def activation_bytes(model_cfg: ModelConfig, micro_batch: int, seq: int, *,
                     act_bytes: int = 2, checkpointing: bool | str | None = None,
                     tile_tokens: int | None = None, device: str = "cuda",
                     hf_config: dict[str, Any] | None = None) -> int:
    """The device's activation peak of one rank's training step (`activation_parts`)."""
    return activation_parts(model_cfg, micro_batch, seq, act_bytes=act_bytes,
                            checkpointing=checkpointing, tile_tokens=tile_tokens,
                            device=device, hf_config=hf_config).peak


def config_activations(cfg: Any, micro_batch: int | None = None, seq: int | None = None,
                       device: str = "cuda") -> Activations:
    """`activation_parts` of a run's whole config (model, sequence, precision, data)."""
    from zerotrain.memory.states import activation_dtype_bytes

    return activation_parts(
        cfg.model, micro_batch or cfg.data.micro_batch_size, seq or cfg.model.block_size,
        act_bytes=activation_dtype_bytes(cfg.precision.dtype),
        tile_tokens=cfg.sequence.tile_tokens, device=device,
        sequence_parallel=cfg.sequence.parallel,
        document_mask=bool(getattr(cfg.data, "document_mask", False)))


def max_seq(fits: Any, lo: int = 1, hi: int = 1 << 24, multiple: int = 1) -> int:
    """The longest sequence, a multiple of `multiple` (sequence parallelism's S: each
    rank takes T/S tokens), for which `fits(seq)` holds (monotone), by bisection; 0 if
    not even the first such length fits."""
    k_lo, k_hi = max(1, -(-lo // multiple)), hi // multiple
    if k_hi < k_lo or not fits(k_lo * multiple):
        return 0
    while k_lo < k_hi:
        mid = (k_lo + k_hi + 1) // 2
        if fits(mid * multiple):
            k_lo = mid
        else:
            k_hi = mid - 1
    return k_lo * multiple
