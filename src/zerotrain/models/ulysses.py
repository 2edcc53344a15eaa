"""Ulysses sequence parallelism: one sequence split along its length over S ranks.

Outside attention every rank holds its slice of T/S consecutive tokens (embeddings,
norms, MLP, head and loss are per-token). Attention needs every position, so it switches
layout: one all-to-all turns [B, H, T/S, D] queries/keys/values (all heads, this rank's
tokens) into [B, H/S, T, D] (this rank's heads, all tokens), the ordinary causal kernel
runs, and one all-to-all turns the output back. Both exchanges go through
`comm.autograd.all_to_all_dims` (byte-counted under purpose "sequence"; the backward is
the inverse exchange).

The engine (`SequenceParallel`) slices each whole batch, enters a `SequenceShard`
context for the forward and backward (the backward too: activation checkpointing
recomputes attention there), and weights the loss. The models read the context:
positions are global (`position_offset`), attention goes through `ulysses_attention`;
Hugging Face models get the same through transformers' attention registry (`hf_hook`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zerotrain.comm.autograd import all_to_all_dims
from zerotrain.comm.collectives import Comm
from zerotrain.config import ConfigError, check_sequence_parallel
from zerotrain.models.documents import active_documents, attention_mask_for, document_positions

#: the name under which Hugging Face models find zerotrain's attention
HF_ATTENTION = "zerotrain_ulysses"


@dataclass(frozen=True)
class SequenceShard:
    """This rank's place in its group's sequence: tokens [offset, offset + T/S) of T."""

    comm: Comm
    offset: int
    length: int  # the whole sequence's length T


_active: SequenceShard | None = None


def active_shard() -> SequenceShard | None:
    """The shard the running forward/backward works on, or None (no sequence parallelism)."""
    return _active


@contextmanager
def sharding(shard: SequenceShard | None) -> Iterator[None]:
    global _active
    before, _active = _active, shard
    try:
        yield
    finally:
        _active = before


def position_offset() -> int:
    """Global position of this rank's first token (0 without sequence parallelism)."""
    return _active.offset if _active is not None else 0


def global_position_ids(idx: Tensor) -> Tensor | None:
    """[B, T_local] global positions for a Hugging Face model's `position_ids` while a
    shard is active (in-document positions while documents are, models/documents.py);
    None otherwise (the model's own 0 .. T-1)."""
    start = position_offset()
    docs = document_positions(start, idx.shape[1])
    if docs is not None or _active is None:
        return docs
    return torch.arange(start, start + idx.shape[1], device=idx.device).expand(idx.shape[0], -1)


def _kv_replication(n_head: int, n_kv: int, sp: int) -> int:
    """The fewest copies r of each KV head (r divides the query group size) that make the
    KV heads split evenly over sp ranks: query head h still reads KV head h // group."""
    group = n_head // n_kv
    return next(r for r in range(1, group + 1) if group % r == 0 and (n_kv * r) % sp == 0)


def to_heads(shard: SequenceShard, q: Tensor, k: Tensor, v: Tensor
             ) -> tuple[Tensor, Tensor, Tensor]:
    """[B, H, T/S, D] (and [B, Hkv, T/S, D]) → this rank's heads over all T tokens, in
    one all-to-all: q, k and v are packed so that rank r's piece holds its heads of each."""
    S = shard.comm.world_size
    B, H, t, D = q.shape
    r = _kv_replication(H, k.shape[1], S)
    if r > 1:  # e.g. one KV head and S = 2: two copies, each rank attends with its own
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    hkv = k.shape[1]
    packed = torch.cat([q.reshape(B, S, H // S, t, D), k.reshape(B, S, hkv // S, t, D),
                        v.reshape(B, S, hkv // S, t, D)], dim=2)
    packed = all_to_all_dims(shard.comm, packed.reshape(B, -1, t, D), 1, 2)
    return packed.split([H // S, hkv // S, hkv // S], dim=1)


def to_sequence(shard: SequenceShard, y: Tensor) -> Tensor:
    """[B, H/S, T, D] attention output → [B, H, T/S, D]: the inverse exchange."""
    return all_to_all_dims(shard.comm, y, 2, 1)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, dropout: float = 0.0,
                     scale: float | None = None) -> Tensor:
    """Causal SDPA over [B, H, T, D]; fewer KV heads are repeated to the query heads.
    With packed documents active, each token reads its own document only."""
    if k.shape[1] < q.shape[1]:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    mask = attention_mask_for(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          dropout_p=dropout, scale=scale)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, dropout: float = 0.0,
                      scale: float | None = None) -> Tensor:
    """Causal attention of [B, H, T_local, D] tensors → [B, H, T_local, D]: plain when no
    shard is active, else over the whole sequence with this rank's heads in between."""
    shard = _active
    if shard is None or shard.comm.world_size == 1:
        return causal_attention(q, k, v, dropout, scale)
    qh, kh, vh = to_heads(shard, q, k, v)
    return to_sequence(shard, causal_attention(qh, kh, vh, dropout, scale))


# ---------------------------------------------------------------------- Hugging Face
def _hf_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Tensor | None, dropout: float = 0.0,
                  scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function signature ([B, H, T, D] in, [B, T, H, D] out).

    Under a shard or packed documents (models/documents.py): causal over the whole
    sequence, within each document when documents are active (a padding mask is not
    supported there; training batches of whole windows have none). Otherwise — the
    same model evaluated, or generating with a KV cache, outside the engine — the
    model's own implementation, with the mask transformers made for it (as sdpa's)."""
    if _active is None and active_documents() is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        own = getattr(getattr(module, "config", None), "_zerotrain_own_attn", None) or "sdpa"
        fn = ALL_ATTENTION_FUNCTIONS[own] if own != "eager" else _eager(module)
        return fn(module, query, key, value, attention_mask, dropout=dropout,
                  scaling=scaling, **kwargs)
    return ulysses_attention(query, key, value, dropout, scaling).transpose(1, 2), None


def _eager(module: nn.Module) -> Any:
    """The model's own eager attention function (its modeling module defines it)."""
    import sys

    return sys.modules[type(module).__module__].eager_attention_forward


def hf_hook(model: nn.Module) -> None:
    """Route a transformers model's attention through `ulysses_attention`: register the
    function in transformers' `AttentionInterface` and select it on the model's config
    (its `_attn_implementation`, which every attention layer reads per call). The user's
    model code is untouched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(HF_ATTENTION, _hf_attention)
    sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]

    def mask(*args: Any, **kwargs: Any) -> Any:  # unused under a shard or documents
        if _active is not None or active_documents() is not None:
            return None
        return sdpa_mask(*args, **kwargs)

    AttentionMaskInterface.register(HF_ATTENTION, mask)
    config = model.config
    own = getattr(config, "_attn_implementation", None)
    if own != HF_ATTENTION:
        config._zerotrain_own_attn = own  # what runs outside a shard (eval, generation)
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        try:
            setter(HF_ATTENTION)
        except (ValueError, KeyError, AttributeError):
            config._attn_implementation = HF_ATTENTION
    else:
        config._attn_implementation = HF_ATTENTION
    if getattr(config, "_attn_implementation", None) != HF_ATTENTION:
        config._attn_implementation = HF_ATTENTION


def _hf_model(module: nn.Module) -> nn.Module | None:
    """The transformers model inside `module` (itself, or zerotrain's `.hf` wrapper)."""
    for m in (module, getattr(module, "hf", None)):
        if m is not None and hasattr(getattr(m, "config", None), "num_attention_heads"):
            return m
    return None


def attention_heads(module: nn.Module) -> tuple[int, int] | None:
    """(query heads, KV heads) of a model whose attention zerotrain can shard, else None."""
    cfg = getattr(module, "cfg", None)
    if getattr(cfg, "arch", None) in ("gpt", "llama") and getattr(cfg, "n_head", None) \
            and getattr(cfg, "hf", None) is None:
        return cfg.n_head, getattr(cfg, "n_kv_head", None) or cfg.n_head
    hf = _hf_model(module)
    if hf is not None:
        c = hf.config
        return c.num_attention_heads, getattr(c, "num_key_value_heads", None) \
            or c.num_attention_heads
    return None


# ---------------------------------------------------------------------- the engine's side
class SequenceParallel:
    """What the engine does for `sequence.parallel: S` > 1.

    - the group: `comm.split(S)`, S consecutive ranks; data-parallel degree world / S;
    - the batch: every rank of a group is handed the same whole batch; `forward` keeps
      this rank's slice of the length and sets the global positions;
    - the loss: each rank's mean over its slice is weighted by its share of the group's
      (non-ignored) targets, so the S shares add up to the whole sequence's mean; the
      value returned is that whole mean (one scalar all-reduce over the group) while the
      gradient flows through this rank's share only;
    - the gradient: the ranks of a group hold partial gradients of one sequence, so the
      reduction over all ranks divides by the data-parallel degree, not the world size
      (`grad_divisor`).
    """

    def __init__(self, size: int, comm: Comm, model: nn.Module):
        heads = attention_heads(model)
        if heads is None:
            raise ConfigError(
                f"sequence.parallel ({size}) needs a model whose attention zerotrain can "
                f"shard (the reference GPT, llama, or a Hugging Face transformers model); "
                f"{type(model).__name__} is none of them; set sequence.parallel 1")
        reference = getattr(getattr(model, "cfg", None), "hf", 1) is None
        check_sequence_parallel(size, comm.world_size, heads[0], heads_field="model.n_head"
                                if reference else "the model's num_attention_heads")
        self.size = size
        self.group = comm.split(size)
        self.rank = self.group.rank
        self.dp_size = comm.world_size // size
        self.last: SequenceShard | None = None
        hf = _hf_model(model)
        if hf is not None:
            hf_hook(hf)
        self.hf_labels = hf is model  # a bare transformers model: HF's `labels` convention

    def _slice(self, t: Tensor, T: int) -> Tensor:
        n = T // self.size
        return t[:, self.rank * n:(self.rank + 1) * n].contiguous()

    def forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Run `module` on this rank's slice of a whole batch (see the class docstring).

        Accepts zerotrain's `(idx, targets)` (targets already shifted, as the sampler
        makes them) or `input_ids=..., labels=...` (Hugging Face's convention: labels
        unshifted, -100 ignored); the returned loss is the whole sequence's mean."""
        args, kwargs = list(args), dict(kwargs)
        if args:
            ids = args[0]
        elif "input_ids" in kwargs:
            ids = kwargs["input_ids"]
        elif "idx" in kwargs:
            ids = kwargs["idx"]
        else:
            raise ValueError("sequence parallelism: pass the token ids first or as input_ids=")
        T = ids.shape[1]
        check_sequence_parallel(self.size, seq_len=T, length_field="the batch's length")
        targets = None
        if "labels" in kwargs and kwargs["labels"] is not None:  # unshifted: shift once here
            lab = kwargs.pop("labels")
            targets = F.pad(lab[:, 1:], (0, 1), value=-100)
        elif len(args) > 1 and args[1] is not None:
            targets = args[1]
        elif kwargs.get("targets") is not None:
            targets = kwargs.pop("targets")
        if len(args) > 1:
            args = args[:1]
        mine = self._slice(ids, T)
        offset = self.rank * (T // self.size)
        local_t = self._slice(targets, T) if targets is not None else None
        if self.hf_labels:
            kwargs.pop("input_ids", None)
            args = []
            kwargs["input_ids"] = mine
            pos = kwargs.get("position_ids")  # whole-length ones (documents') are sliced
            kwargs["position_ids"] = torch.arange(offset, offset + T // self.size,
                                                  device=ids.device).expand(ids.shape[0], -1) \
                if pos is None else self._slice(pos.expand(ids.shape[0], -1), T) \
                if pos.shape[-1] == T else pos
            if local_t is not None:  # HF's loss takes pre-shifted labels as shift_labels
                kwargs["labels"] = local_t
                kwargs["shift_labels"] = local_t
        else:
            kwargs.pop("input_ids", None)
            kwargs.pop("idx", None)
            args = [mine] + ([local_t] if local_t is not None else [])
        self.last = SequenceShard(self.group, offset, T)
        with sharding(self.last):
            out = module(*args, **kwargs)
        if targets is None:
            return out
        counts = torch.stack([(local_t != -100).sum(), (targets != -100).sum()]).double()
        if isinstance(out, Tensor):
            return self._whole_loss(out, counts)
        out["loss"] = self._whole_loss(out["loss"], counts)
        return out

    def _whole_loss(self, local_mean: Tensor, counts: Tensor) -> Tensor:
        """This slice's share of the whole batch's mean; its value the whole mean. No host
        sync (S-5): the empty-slice case by `where`, the sum reduced on the device."""
        ratio = (counts[0] / counts[1].clamp(min=1)).to(local_mean.dtype)
        # no target on this slice: its mean is 0/0; its share is 0 (no NaN in backward)
        share = torch.where(counts[0] > 0, local_mean * ratio, local_mean.nan_to_num(0.0) * 0.0)
        whole = share.detach().double().reshape(1).to(self.group.device)
        self.group.all_reduce(whole, purpose="control")
        whole = whole[0].to(share.device, share.dtype)
        return share + (whole - share.detach())

    @contextmanager
    def backward_context(self) -> Iterator[None]:
        """The last forward's shard again: checkpointed attention recomputes in backward."""
        with sharding(self.last):
            yield


__all__ = ["HF_ATTENTION", "SequenceParallel", "SequenceShard", "active_shard",
           "attention_heads", "causal_attention", "global_position_ids", "hf_hook",
           "position_offset", "sharding", "to_heads", "to_sequence", "ulysses_attention"]
