"""Long sequences, wired into a model: the tiled loss head and MLPs (`tiling.py`'s math)
and activation checkpointing (`checkpointing.py`) applied to a built model from its plan —
zerotrain's families, Hugging Face causal LMs and any module — without editing its code;
and the engine's forward and backward through document masking (`documents.py`) and
sequence parallelism (`ulysses.py`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zerotrain.config import ConfigError, DataConfig
from zerotrain.models import gpt, hf, llama, ulysses
from zerotrain.models.checkpointing import apply_checkpointing
from zerotrain.models.documents import DocumentMasking, eos_token_id
from zerotrain.models.tiling import _TILED, IGNORE_INDEX, tiled_lm_loss, tiled_mlp

# ----------------------------------------------------------------------------- wiring

#: logit transforms some HF families apply after lm_head; tiling would silently drop them
_HF_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                        "output_multiplier_scale")


def is_position_wise_mlp(m: nn.Module | None) -> bool:
    """The MLPs tiling may cut: the reference GPT's and llama's, and llama-style HF MLPs
    (gate_proj, up_proj, down_proj) — position-wise by construction."""
    if m is None:
        return False
    if getattr(type(m), "position_wise", False):  # zerotrain's own MLPs say so
        return True
    return all(isinstance(getattr(m, n, None), nn.Linear)
               for n in ("gate_proj", "up_proj", "down_proj"))


def _wrap_mlp(m: nn.Module, tile: int | None) -> bool:
    current = m.__dict__.get("forward")
    if current is not None and hasattr(current, _TILED):
        del m.forward
    if tile is None:
        return False
    original = m.forward

    def forward(x: Tensor) -> Tensor:
        return tiled_mlp(m, original, x, tile)

    setattr(forward, _TILED, original)
    m.forward = forward
    return True


def hf_head_check(hf_model: nn.Module) -> nn.Module:
    """The HF model's output head, refusing families that transform logits after it."""
    conf = getattr(hf_model, "config", None)
    for name in _HF_LOGIT_TRANSFORMS:
        v = getattr(conf, name, None)
        if v not in (None, 1, 1.0):
            raise ConfigError(f"sequence.tile_tokens: this Hugging Face model applies "
                              f"{name}={v} to its logits, which tiled loss does not "
                              "reproduce; set sequence.tile_tokens null")
    head = hf_model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ConfigError("sequence.tile_tokens needs a Hugging Face model whose output head "
                          f"is an nn.Linear (got {type(head).__name__}); set "
                          "sequence.tile_tokens null")
    return head


def hf_hidden_states(hf_model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The base model's output (last hidden state first) of an HF causal LM."""
    return hf_model.base_model(*args, **kwargs)


def _wrap_hf_forward(model: nn.Module, tile: int | None) -> None:
    """A raw HF causal LM: with `labels`, the loss from the base model's hidden states,
    tile by tile (labels shifted as HF does: position i predicts labels[i + 1]; HF's
    pre-shifted `shift_labels`, when given, are the targets as they are)."""
    current = model.__dict__.get("forward")
    if current is not None and hasattr(current, _TILED):
        del model.forward
    if tile is None:
        return
    head = hf_head_check(model)
    original = model.forward

    def forward(*args: Any, labels: Tensor | None = None,
                shift_labels: Tensor | None = None, **kwargs: Any) -> Any:
        if labels is None and shift_labels is None:
            return original(*args, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        for k in ("logits_to_keep", "num_items_in_batch", "return_dict"):
            kwargs.pop(k, None)
        kwargs.setdefault("use_cache", False)  # a loss needs no KV cache; it would hold k, v
        out = hf_hidden_states(model, *args, return_dict=True, **kwargs)
        # HF's `shift_labels` are already shifted (sequence parallelism passes its slice's
        # targets so): they are the targets as given, not shifted a second time
        targets = shift_labels if shift_labels is not None else \
            F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        loss = tiled_lm_loss(out.last_hidden_state, head, targets, tile)
        return CausalLMOutputWithPast(loss=loss, logits=None)

    setattr(forward, _TILED, original)
    model.forward = forward


def apply_tiling(model: nn.Module, blocks: tuple[nn.Module, ...], tile: int | None) -> int:
    """Tile the loss head and the blocks' MLPs of `model` (None: undo). Returns the number
    of MLPs tiled. Raises ConfigError for a model whose loss head cannot be found."""
    if isinstance(model, (gpt.GPT, llama.Llama, hf.HFCausalLM)):
        if isinstance(model, hf.HFCausalLM) and tile is not None:
            hf_head_check(model.hf)
        model.tile_tokens = tile
    elif callable(getattr(model, "get_output_embeddings", None)) and hasattr(model,
                                                                             "base_model"):
        _wrap_hf_forward(model, tile)
    elif tile is not None:
        raise ConfigError(
            f"sequence.tile_tokens tiles the loss of zerotrain's models and Hugging Face causal "
            f"LMs; {type(model).__name__} is neither (no output head to tile): set "
            "sequence.tile_tokens null")
    n = 0
    for b in blocks:
        mlp = getattr(b, "mlp", None)
        if is_position_wise_mlp(mlp):
            n += _wrap_mlp(mlp, tile)
    return n


def apply_long_sequence(model: nn.Module, blocks: tuple[nn.Module, ...],
                        checkpointing: bool | str, tile: int | None,
                        device: torch.device) -> str | None:
    """The engine's one call: activation checkpointing of the plan's blocks (when the
    config asks; a zerotrain model already follows its own model config) and tiling.
    Returns a line to say once, or None."""
    note = None
    if checkpointing == "offload" and device.type != "cuda":
        note = ("[zerotrain] model.activation_checkpointing offload: on a CPU the host is "
                "the device, so this is checkpointing without offload (same as true)")
        checkpointing = True
    if checkpointing:
        apply_checkpointing(blocks, checkpointing)
    apply_tiling(model, blocks, tile)
    return note


# ------------------------------------------------------------- the engine's forward/backward
def document_masking(data: DataConfig, model: nn.Module) -> DocumentMasking | None:
    """`data.document_mask`'s engine side, or None when off. The EOS id is
    data.eos_token_id, else the Hugging Face model's; ConfigError when neither is known."""
    if not data.document_mask:
        return None
    inner = getattr(model, "hf", model)
    if isinstance(model, hf.HFCausalLM) or hasattr(getattr(inner, "config", None),
                                                   "num_attention_heads"):
        ulysses.hf_hook(inner)  # attention (and its mask) through zerotrain's function
    conf = getattr(inner, "config", None)
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None) \
        or getattr(conf, "vocab_size", None)
    return DocumentMasking(eos_token_id(data.eos_token_id, model), model,
                           vocab if isinstance(vocab, int) else None)


def sequence_forward(module: nn.Module, sp: ulysses.SequenceParallel | None,
                     docs: DocumentMasking | None, args: tuple, kwargs: dict) -> Any:
    """The module's forward on a whole batch: its documents found (when masking), then
    this rank's slice of it (when sequence-parallel)."""
    def call(*a: Any, **k: Any) -> Any:
        return sp.forward(module, a, k) if sp is not None else module(*a, **k)

    return docs.forward(call, args, kwargs) if docs is not None else call(*args, **kwargs)


@contextmanager
def sequence_backward(sp: ulysses.SequenceParallel | None,
                      docs: DocumentMasking | None) -> Iterator[None]:
    """The last forward's shard and documents again, for recomputation in backward."""
    with ExitStack() as stack:
        if sp is not None:
            stack.enter_context(sp.backward_context())
        if docs is not None:
            stack.enter_context(docs.backward_context())
        yield
