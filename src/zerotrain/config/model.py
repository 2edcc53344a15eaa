"""model: and data: — which model, which tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from zerotrain.config.base import ConfigError, _Section

#: What each model family takes for a field left null (`_family_defaults` applies them).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt": {"bias": True, "tie_weights": True},
    "llama": {"bias": False, "tie_weights": False},
}
#: Sizes of a model given neither a preset nor a Hugging Face folder (today's small GPT).
BASE_SIZES: dict[str, int] = {"n_layer": 4, "n_head": 4, "n_embd": 128}

def llama_intermediate_size(n_embd: int) -> int:
    """SwiGLU hidden width: 8/3 of n_embd (the same parameters as a 4x GELU MLP), rounded
    up to a multiple of 64 so matrix shapes stay friendly to kernels."""
    return -(-(8 * n_embd // 3) // 64) * 64


class MoEConfig(_Section):
    """A mixture of experts in place of each block's MLP (llama family; docs/moe.md)."""

    experts: int = Field(8, ge=2, description="experts per MoE layer")
    top_k: int = Field(2, ge=1, description="experts each token is sent to")
    capacity_factor: float | None = Field(
        None, gt=0.0, description="null: dropless (every token reaches its experts); f: an "
        "expert takes at most ceil(f * tokens * top_k / experts) tokens, the rest skip it")
    aux_loss: float = Field(0.01, ge=0.0, description="load-balancing loss coefficient")
    z_loss: float = Field(0.001, ge=0.0, description="router z-loss coefficient")
    expert_parallel: int = Field(
        1, ge=1, description="ranks an expert layer's experts are spread over (1: every "
        "rank holds every expert, sharded by ZeRO like any parameter)")

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.top_k > self.experts:
            raise ValueError(f"model.moe.top_k ({self.top_k}) exceeds model.moe.experts "
                             f"({self.experts}); lower top_k or add experts")
        if self.experts % self.expert_parallel:
            raise ValueError(f"model.moe.expert_parallel ({self.expert_parallel}) must divide "
                             f"model.moe.experts ({self.experts}): each rank of an EP group "
                             "holds as many experts; use a divisor of the expert count")
        return self


class ModelConfig(_Section):
    """Which model and how big. Fields left null take the preset's value (`preset`), then
    the family's default; `hf` builds any Hugging Face causal LM from a local folder."""

    arch: Literal["gpt", "llama"] | None = Field(
        None, description="gpt | llama; null: the preset's family, else gpt")
    preset: str | None = Field(
        None, description="named size (gpt-tiny, llama-60m, ...): fills the size fields left "
        "null; see zerotrain.models.presets")
    hf: str | None = Field(
        None, description="local folder with a Hugging Face config.json (and optionally "
        "safetensors weights): build that model instead of arch")
    init_from: str | None = Field(
        None, description="start from these weights: a zerotrain export (.safetensors) or a "
        "folder of safetensors (Hugging Face layout)")
    n_layer: int | None = Field(None, ge=1)
    n_head: int | None = Field(None, ge=1)
    n_kv_head: int | None = Field(
        None, ge=1, description="llama: key/value heads (grouped-query attention); null: n_head")
    n_embd: int | None = Field(None, ge=1)
    intermediate_size: int | None = Field(
        None, ge=1, description="MLP width; null: the family's rule (gpt: mlp_ratio*n_embd, "
        "llama: 8/3*n_embd rounded up to a multiple of 64)")
    block_size: int = Field(128, ge=2, description="context length (sequence length)")
    vocab_size: int = Field(256, ge=2, description="default: the tokenizer's vocabulary")
    mlp_ratio: int = Field(4, ge=1, description="gpt: MLP width as a multiple of n_embd")
    bias: bool | None = Field(None, description="null: the family's default (gpt yes, llama no)")
    tie_weights: bool | None = Field(
        None, description="share the token embedding with the output head; null: the "
        "family's default (gpt yes, llama no)")
    rope_theta: float = Field(10000.0, gt=0.0, description="llama: rotary base wavelength")
    norm_eps: float = Field(1e-5, gt=0.0, description="epsilon of the normalisation layers")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    moe: MoEConfig | None = Field(
        None, description="llama: a mixture of experts for every MLP ({experts, top_k, "
        "capacity_factor, aux_loss, z_loss}); intermediate_size is then each expert's width")
    activation_checkpointing: bool | Literal["offload"] = Field(
        False, description="recompute each block (the plan's units) in backward instead of "
        "keeping its activations: false | true | offload (also keep each block's input in "
        "pinned host memory; on a CPU the same as true)")

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _checkpointing(cls, v: Any) -> Any:
        if v in (False, True, "offload"):
            return v
        raise ValueError(f"model.activation_checkpointing is false, true or offload, got {v!r}")

    @model_validator(mode="before")
    @classmethod
    def _family_defaults(cls, data: Any) -> Any:
        """The one place a null field gets its family's value (before validation, so the
        filled values are checked like given ones)."""
        if not isinstance(data, dict):
            return data
        d = dict(data)
        if d.get("preset") is None and d.get("hf") is None:
            d["arch"] = d.get("arch") or "gpt"
            for k, v in BASE_SIZES.items():
                d[k] = v if d.get(k) is None else d[k]
        arch = d.get("arch")
        family = FAMILY_DEFAULTS.get(arch) if isinstance(arch, str) else None
        if family is None or d.get("hf") is not None:
            return d
        for k, v in family.items():
            d[k] = v if d.get(k) is None else d[k]
        n_head, n_embd = d.get("n_head"), d.get("n_embd")
        if d.get("n_kv_head") is None and isinstance(n_head, int):
            d["n_kv_head"] = n_head
        if d.get("intermediate_size") is None and isinstance(n_embd, int):
            ratio = d.get("mlp_ratio", 4)
            d["intermediate_size"] = (llama_intermediate_size(n_embd) if d["arch"] == "llama"
                                      else ratio * n_embd if isinstance(ratio, int) else None)
        return d

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.hf is not None and (self.preset is not None or self.arch is not None):
            raise ValueError("model.hf builds the model its config.json describes; remove "
                             "model.preset / model.arch")
        if self.n_head and self.n_embd and self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})"
            )
        if self.n_head and self.n_kv_head and self.n_head % self.n_kv_head:
            raise ValueError(f"model.n_head ({self.n_head}) must be a multiple of "
                             f"model.n_kv_head ({self.n_kv_head})")
        if self.moe is not None and self.hf is not None \
                and self.moe.model_copy(update={"expert_parallel": 1}) != MoEConfig():
            raise ValueError("model.moe applies to model.arch llama; a model.hf folder's "
                             "experts (if any) come from its config.json: remove model.moe "
                             "(only model.moe.expert_parallel applies to a model.hf MoE)")
        if self.moe is not None and self.bias:
            raise ValueError("model.moe's experts and router have no biases; remove "
                             "model.bias (or set it false)")
        if self.moe is not None and self.arch == "gpt":
            raise ValueError("model.moe applies to model.arch llama (got gpt); set "
                             "model.arch llama or a llama preset such as llama-moe-tiny")
        if self.arch == "gpt":
            foreign = [f"model.{k} = {getattr(self, k)}" for k, ok in (
                ("n_kv_head", self.n_kv_head in (None, self.n_head)),
                ("intermediate_size", self.intermediate_size in (
                    None, self.mlp_ratio * (self.n_embd or 0))),
                ("rope_theta", self.rope_theta == 10000.0),
                ("norm_eps", self.norm_eps == 1e-5)) if not ok]
            if foreign:
                raise ValueError(f"model.arch gpt does not use {', '.join(foreign)} (GPT: "
                                 "full attention heads, mlp_ratio, learned positions, LayerNorm "
                                 "eps 1e-5); remove it or set model.arch llama")
        return self


class DataConfig(_Section):
    path: str | None = Field(
        None, description="text file, folder of text files, .jsonl/.parquet, a token-shard "
        "folder or a .bin from `zerotrain prepare`; None = the embedded corpus (this "
        "interpreter's standard-library sources)"
    )
    tokenizer: str = Field(
        "bytes", description="bytes (vocab 256), a tokenizer.json, a local Hugging Face "
        "tokenizer folder, or bpe:N (train an N-token byte-level BPE on the training text)"
    )
    text_field: str = Field("text", description=".jsonl/.parquet: the field holding the text")
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5)
    micro_batch_size: int = Field(16, ge=1, description="sequences per rank per micro-step")
    grad_accum_steps: int = Field(1, ge=1)
    document_mask: bool = Field(
        False, description="packed sequences: a token attends only to earlier tokens of its "
        "own document (documents end at data.eos_token_id), positions restart at 0 in each "
        "document, and the prediction across a document boundary is not scored (memory: "
        "a [T x T] mask per sequence; docs/design.md §documents); false: plain causal "
        "attention over the whole window")
    eos_token_id: int | None = Field(
        None, ge=0, description="the token that ends a document (data.document_mask); null: "
        "the tokenizer's end-of-text token, else the Hugging Face model's eos_token_id")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if v is not None and not str(v).strip():  # '' would read the current directory
            raise ValueError("data.path is empty; give a file or folder, or null for the "
                             "embedded corpus")
        return v

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_spec(cls, v: str) -> str:
        if v.startswith("bpe:"):
            n = v[4:]
            if not n.isdigit() or int(n) < 258:
                raise ValueError(f"data.tokenizer '{v}': write bpe:N with N >= 258 (256 bytes, "
                                 "an end-of-text token and at least one merge), e.g. bpe:4096")
        elif not v:
            raise ValueError("data.tokenizer is empty; use bytes, a tokenizer path or bpe:N")
        return v


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """A Hugging Face model folder's config.json, as a dict."""
    path = Path(folder).expanduser() / "config.json"
    if not path.is_file():
        raise ConfigError(f"model.hf '{folder}' has no config.json; point it at a local "
                          "Hugging Face model folder")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf: cannot read '{path}': {e}") from None
