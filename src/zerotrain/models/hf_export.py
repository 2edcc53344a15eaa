"""Writing zerotrain models in Hugging Face's format, and the names that link the two.

Reference GPT -> `GPT2LMHeadModel`. The architectures are the same function:
- GPT-2 keeps its linears as `Conv1D`, whose weight is (in, out): the transpose of
  `nn.Linear`'s (out, in). qkv, attention proj, fc and MLP proj are transposed.
- Activation: ours is `gelu(approximate="tanh")`; HF's `gelu_pytorch_tanh` calls exactly
  that (`gelu_new` is the same curve written out, equal to ~1e-7 only).
- LayerNorm eps: ours is torch's default 1e-5 = GPT-2's `layer_norm_epsilon`.
- Attention scale 1/sqrt(head dim) in both; dropout sites match (embeddings, attention
  probabilities, after each residual branch).
- GPT-2 always has biases; a bias-free GPT exports zero biases (the same function).
- A tied head is not written: HF ties `lm_head` to `wte` itself (`tie_word_embeddings`).
Llama -> `LlamaForCausalLM`: a pure renaming (zerotrain's llama uses HF's rotary layout).
`model.hf` models go back under their own names and config.json.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from zerotrain.config import ModelConfig
from zerotrain.models.hf import PREFIX, build_hf
from zerotrain.models.hf_convert import to_disk_layout
from zerotrain.models.presets import read_hf_config, resolve_model_config

_GPT_TOP = {"wte": "transformer.wte", "wpe": "transformer.wpe", "ln_f": "transformer.ln_f",
            "head": "lm_head"}
_GPT_BLOCK = {"ln1": ("ln_1", False), "ln2": ("ln_2", False),
              "attn.qkv": ("attn.c_attn", True), "attn.proj": ("attn.c_proj", True),
              "mlp.fc": ("mlp.c_fc", True), "mlp.proj": ("mlp.c_proj", True)}
_LLAMA_TOP = {"embed": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"}
_LLAMA_BLOCK = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                "attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj",
                "attn.v": "self_attn.v_proj", "attn.o": "self_attn.o_proj",
                "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}


#: a llama MoE layer's names in `MixtralForCausalLM` (in memory: experts fused)
_MOE_BLOCK = {"mlp.router.weight": "mlp.gate.weight", "mlp.experts.gate_up":
              "mlp.experts.gate_up_proj", "mlp.experts.down": "mlp.experts.down_proj"}


def hf_name(arch: str | None, name: str) -> tuple[str, bool]:
    """(HF name, stored transposed?) of a zerotrain parameter name (a llama MoE's expert
    names: Mixtral's in-memory ones; `hf_convert` turns them into the on-disk ones)."""
    if arch is None:  # a model.hf wrapper: its own names under the prefix
        return name.removeprefix(PREFIX), False
    if name.startswith("blocks.") and ".mlp." in name:
        _, i, rest = name.split(".", 2)
        if rest in _MOE_BLOCK:
            return f"model.layers.{i}.{_MOE_BLOCK[rest]}", False
    module, _, leaf = name.rpartition(".")
    if module.startswith("blocks."):
        _, i, rest = module.split(".", 2)
        if arch == "gpt":
            new, transposed = _GPT_BLOCK[rest]
            return f"transformer.h.{i}.{new}.{leaf}", transposed and leaf == "weight"
        return f"model.layers.{i}.{_LLAMA_BLOCK[rest]}.{leaf}", False
    top = _GPT_TOP if arch == "gpt" else _LLAMA_TOP
    return f"{top[module]}.{leaf}", False


def _gpt_config(c: ModelConfig) -> dict[str, Any]:
    assert c.n_embd is not None
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": c.vocab_size, "n_positions": c.block_size, "n_embd": c.n_embd,
            "n_layer": c.n_layer, "n_head": c.n_head, "n_inner": c.mlp_ratio * c.n_embd,
            "activation_function": "gelu_pytorch_tanh", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
            "scale_attn_weights": True, "tie_word_embeddings": bool(c.tie_weights),
            "bos_token_id": None, "eos_token_id": None}


def _llama_config(c: ModelConfig) -> dict[str, Any]:
    assert c.n_embd is not None and c.n_head is not None
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": c.vocab_size, "hidden_size": c.n_embd,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.n_layer,
            "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head,
            "head_dim": c.n_embd // c.n_head, "max_position_embeddings": c.block_size,
            "rms_norm_eps": c.norm_eps, "hidden_act": "silu",
            # transformers 5 reads rope_parameters, 4.x rope_theta
            "rope_parameters": rope, "rope_theta": c.rope_theta,
            "attention_bias": bool(c.bias), "mlp_bias": bool(c.bias),
            "attention_dropout": c.dropout, "tie_word_embeddings": bool(c.tie_weights),
            "bos_token_id": None, "eos_token_id": None}


def _mixtral_config(c: ModelConfig) -> dict[str, Any]:
    """A llama MoE is Mixtral: llama attention, softmax-top-k-renormalised routing, SwiGLU
    experts of width intermediate_size."""
    assert c.moe is not None
    conf = {k: v for k, v in _llama_config(c).items() if k not in ("mlp_bias", "head_dim")}
    return {**conf, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": c.moe.experts, "num_experts_per_tok": c.moe.top_k,
            "router_aux_loss_coef": c.moe.aux_loss, "router_jitter_noise": 0.0,
            "sliding_window": None, "head_dim": c.n_embd // (c.n_head or 1)}


def hf_config_of(c: ModelConfig) -> dict[str, Any]:
    """config.json of a resolved gpt or llama config's Hugging Face twin."""
    if c.arch == "gpt":
        return _gpt_config(c)
    return _mixtral_config(c) if c.moe is not None else _llama_config(c)


def hf_twin(c: ModelConfig) -> nn.Module:
    """The Hugging Face model of a resolved config, on the meta device (its names and
    transformers' conversion rules, no memory)."""
    with torch.device("meta"):
        if c.hf is not None:
            return build_hf(c).hf
        return build_hf(c, hf_config_of(c)).hf


def to_hf(model_cfg: ModelConfig, state_dict: dict[str, Tensor],
          hf_config: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config.json dict, HF state dict) for a full zerotrain state dict (tied names may
    or may not be present). `hf_config`: a `model.hf` model's own config.json."""
    c = resolve_model_config(model_cfg, hf_config=hf_config)
    if c.hf is not None:
        if hf_config is None:
            hf_config = read_hf_config(c.hf)
        with torch.device("meta"):  # transformers' own rules give the on-disk layout
            meta = build_hf(c, hf_config).hf
        return dict(hf_config), to_disk_layout(
            meta, {hf_name(None, k)[0]: v for k, v in state_dict.items()})
    if c.moe is not None:
        sd = {hf_name(c.arch, k)[0]: v for k, v in state_dict.items()
              if not (k == "head.weight" and c.tie_weights)}
        return _mixtral_config(c), to_disk_layout(hf_twin(c), sd)
    out: dict[str, Tensor] = {}
    for name, t in state_dict.items():
        if name == "head.weight" and c.tie_weights:
            continue
        new, transposed = hf_name(c.arch, name)
        out[new] = t.t() if transposed else t
    if c.arch == "gpt" and not c.bias:  # GPT-2 has biases everywhere: zero is the same function
        for name, t in list(out.items()):
            if name.endswith(".weight") and name != "lm_head.weight" and "wte" not in name \
                    and "wpe" not in name:
                out[name.removesuffix("weight") + "bias"] = t.new_zeros(
                    t.shape[-1] if t.ndim == 2 else t.shape[0])
    return (_gpt_config(c) if c.arch == "gpt" else _llama_config(c)), out


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def save_hf(folder: str | Path, model_cfg: ModelConfig, state_dict: dict[str, Tensor],
            dtype: torch.dtype = torch.float32, hf_config: dict[str, Any] | None = None) -> Path:
    """Write `config.json` + `model.safetensors` that `from_pretrained(folder)` loads.
    Written into a temporary folder renamed at the end, so a crash leaves no half export."""
    config, sd = to_hf(model_cfg, state_dict, hf_config)
    config["dtype"] = config["torch_dtype"] = _DTYPE_NAMES[dtype]
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().to(dtype if v.is_floating_point() else v.dtype).contiguous().clone()
               for k, v in sd.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder
