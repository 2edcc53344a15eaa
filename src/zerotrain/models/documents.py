"""Document masking for packed sequences (`data.document_mask`): attention does not cross
an end-of-document token.

A training window of T tokens packs several documents, each ended by the EOS token the
data pipeline put between them (`data/shards.py`). With the option on:

- a token attends only to the earlier tokens of its own document (an EOS belongs to the
  document it ends): SDPA with an additive block-diagonal causal mask instead of
  `is_causal=True`;
- positions (GPT's learned, llama's rotary, a Hugging Face model's `position_ids`)
  restart at 0 at each document, as if each document were fed alone — Hugging Face's
  packing convention (`DataCollatorWithFlattening`), which its flash/sdpa paths read;
- the prediction made at an EOS (of the next document's first token, which nothing in
  the EOS's document can know) is not scored: its target becomes -100, as
  `DataCollatorWithFlattening` masks the first label of each document.

So a packed window gives each document the logits, loss terms and gradients it would
get alone. The engine (`DocumentMasking`) computes the documents of the whole batch
before sequence parallelism slices it — every rank of an SP group is handed the same
whole batch, so each knows the whole sequence's documents, which attention needs after
the all-to-all (all T tokens, H/S heads) — and enters a `documents` context for the
forward and the backward (checkpointed blocks recompute attention there). Models read
the context: `document_positions` for positions, `attention_mask_for` in attention.

Memory: the mask is one [B, 1, T, T] tensor in the attention's dtype per forward
(B·T²·2-4 bytes), shared by every layer (a boolean mask would be converted to a fresh
float copy by each layer's SDPA and saved for its backward), freed after the backward.
At T = 4,096 that is 64 MiB per fp32 sequence; at 32,768, 4 GiB — see
`memory/activations.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from zerotrain.config import ConfigError

IGNORE_INDEX = -100


@dataclass
class Documents:
    """The documents of a whole batch [B, T] of packed token ids."""

    ids: Tensor        # [B, T] document index of each token (0, 1, ... per row)
    positions: Tensor  # [B, T] position of each token within its document
    single: bool       # no row holds a boundary: plain causal attention is the same
    _masks: dict[torch.dtype, Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, idx: Tensor, eos: int) -> Documents:
        ends = (idx == eos).long()
        ids = ends.cumsum(1) - ends  # EOS tokens strictly before: an EOS ends its document
        T = idx.shape[1]
        t = torch.arange(T, device=idx.device).expand_as(idx)
        starts = torch.zeros_like(ids)  # index where each token's document starts
        starts[:, 1:] = torch.where(ends[:, :-1].bool(), t[:, 1:], 0)
        positions = t - starts.cummax(1).values
        return cls(ids, positions, bool((ids[:, -1] == 0).all()))

    def mask(self, dtype: torch.dtype) -> Tensor:
        """[B, 1, T, T] additive mask: 0 where query i may read key j (same document,
        j <= i), -inf elsewhere. Made once per dtype and forward, shared by the layers."""
        m = self._masks.get(dtype)
        if m is None:  # built in place: B·T² bytes of booleans beside the mask, no more
            allowed = (self.ids[:, :, None] == self.ids[:, None, :]).tril_()
            m = torch.zeros(allowed.shape, dtype=dtype, device=self.ids.device)
            m.masked_fill_(allowed.logical_not_(), float("-inf"))
            del allowed
            self._masks[dtype] = m = m.unsqueeze(1)
        return m

    def release(self) -> None:
        self._masks.clear()


_active: Documents | None = None


def active_documents() -> Documents | None:
    return _active


@contextmanager
def documents(docs: Documents | None) -> Iterator[None]:
    global _active
    before, _active = _active, docs
    try:
        yield
    finally:
        _active = before


def document_positions(start: int, length: int) -> Tensor | None:
    """[B, length] in-document positions of tokens start .. start + length - 1 of the
    whole sequence while documents are active; None otherwise (positions as usual)."""
    if _active is None:
        return None
    return _active.positions[:, start:start + length]


def attention_mask_for(q: Tensor) -> Tensor | None:
    """The additive document mask for attention over the whole sequence (q: [B, H, T, D]),
    or None: no documents active, or no boundary in the batch (causal SDPA is the same)."""
    if _active is None or _active.single:
        return None
    if q.shape[2] != _active.ids.shape[1]:
        raise ValueError(f"data.document_mask: attention over {q.shape[2]} tokens, but the "
                         f"batch's documents span {_active.ids.shape[1]}")
    return _active.mask(q.dtype)


def mask_targets(targets: Tensor, idx: Tensor, eos: int) -> Tensor:
    """Shifted targets (position i predicts targets[i]) with the predictions made at an
    EOS — across a document boundary — ignored."""
    return targets.masked_fill(idx == eos, IGNORE_INDEX)


def mask_labels(labels: Tensor, idx: Tensor, eos: int) -> Tensor:
    """Hugging Face's unshifted labels (labels[i] is predicted at i - 1): the first label
    of each document ignored."""
    out = labels.clone()
    out[:, 1:].masked_fill_(idx[:, :-1] == eos, IGNORE_INDEX)
    return out


def eos_token_id(configured: int | None, model: nn.Module) -> int:
    """data.eos_token_id, else the Hugging Face model's config.eos_token_id (one id)."""
    if configured is not None:
        return configured
    hf = model if hasattr(getattr(model, "config", None), "eos_token_id") \
        else getattr(model, "hf", None)
    eos = getattr(getattr(hf, "config", None), "eos_token_id", None)
    if isinstance(eos, list) and len(eos) == 1:
        eos = eos[0]
    if isinstance(eos, int) and not isinstance(eos, bool):
        return eos
    raise ConfigError(
        "data.document_mask needs the token that ends a document: set data.eos_token_id "
        "(the id your data puts between documents), or use a tokenizer with an end-of-text "
        "token (data.tokenizer bpe:N or a Hugging Face tokenizer; the byte tokenizer has "
        "none); or set data.document_mask false")


class DocumentMasking:
    """The engine's side of `data.document_mask` (see the module docstring)."""

    def __init__(self, eos: int, model: nn.Module, vocab: int | None = None):
        if vocab is not None and not 0 <= eos < vocab:
            raise ConfigError(f"data.eos_token_id ({eos}) is not a token of the model's "
                              f"vocabulary (0 .. {vocab - 1}); give the id your data puts "
                              "between documents")
        self.eos = eos
        # a bare transformers model reads positions from its position_ids argument
        self.pass_positions = hasattr(getattr(model, "config", None), "num_attention_heads")
        self.last: Documents | None = None

    def forward(self, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """`call(*args, **kwargs)` on the whole batch, with its documents active and its
        boundary predictions ignored (`(idx, targets)` or `input_ids=, labels=`)."""
        args, kwargs = list(args), dict(kwargs)
        key = next((k for k in ("input_ids", "idx") if k in kwargs), None)
        ids = args[0] if args else kwargs[key] if key is not None else None
        if ids is None:
            raise ValueError("data.document_mask: pass the token ids first or as input_ids=")
        pad = kwargs.get("attention_mask")
        if pad is not None and not bool(pad.bool().all()):
            raise ValueError("data.document_mask: a padding attention_mask is not supported "
                             "(documents are packed, not padded); pass none, or pad only "
                             "on the right with -100 labels and no attention_mask")
        if len(args) > 1 and args[1] is not None:
            args[1] = mask_targets(args[1], ids, self.eos)
        if kwargs.get("targets") is not None:
            kwargs["targets"] = mask_targets(kwargs["targets"], ids, self.eos)
        if kwargs.get("labels") is not None:
            kwargs["labels"] = mask_labels(kwargs["labels"], ids, self.eos)
        docs = Documents.of(ids, self.eos)
        if self.pass_positions and kwargs.get("position_ids") is None:
            kwargs["position_ids"] = docs.positions  # whole: sequence parallelism slices it
        if not torch.is_grad_enabled():  # evaluation: no backward will need the mask, so
            with documents(docs):  # it goes now (its B·T² stayed until the next training
                out = call(*args, **kwargs)  # forward); a training forward's stays kept
            docs.release()
            return out
        self.last = docs
        with documents(docs):
            return call(*args, **kwargs)

    @contextmanager
    def backward_context(self) -> Iterator[None]:
        """The last forward's documents again (checkpointed attention recomputes in
        backward); the mask is freed after."""
        try:
            with documents(self.last):
                yield
        finally:
            if self.last is not None:
                self.last.release()


__all__ = ["DocumentMasking", "Documents", "active_documents", "attention_mask_for",
           "document_positions", "documents", "eos_token_id", "mask_labels", "mask_targets"]
