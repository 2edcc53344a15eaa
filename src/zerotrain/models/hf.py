"""Any Hugging Face causal LM, from a local folder, behind zerotrain's model interface.

`model.hf: FOLDER` names a folder with a `config.json` (and optionally safetensors weights,
one file or sharded with an index; `weights.py` reads them slice by slice). The model is
built with `AutoModelForCausalLM.from_config` in FP32 (the engine owns precision), and
wrapped so that, like zerotrain's own families, `forward(idx, targets)` returns logits or
the mean FP32 cross-entropy of already-shifted targets (HF's `labels` shift internally;
the sampler's targets are shifted once already). The wrapper's parameters are the HF
model's under the prefix `hf.`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from zerotrain.config import ConfigError, ModelConfig
from zerotrain.models.hf_experts import swap_hf_experts
from zerotrain.models.plan import Plan, largest_module_list, plan_from
from zerotrain.models.presets import read_hf_config
from zerotrain.models.sampling import CausalLM, lm_loss
from zerotrain.models.ulysses import global_position_ids
from zerotrain.models.weights import weight_files

PREFIX = "hf."


def transformers_module():
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.hf and Hugging Face export need the transformers package; "
                          "install it with `pip install transformers`") from None
    return transformers


def has_weights(folder: str | Path) -> bool:
    p = Path(folder).expanduser()
    return p.is_dir() and bool(weight_files(p))


class HFCausalLM(CausalLM):
    """An HF causal LM with zerotrain's `forward(idx, targets)` and `generate`."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, hf_config: dict[str, Any]):
        super().__init__()
        self.hf = model
        self.cfg = cfg
        self.hf_config = hf_config  # what config.json said: export writes it back

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        # global positions of this rank's slice under sequence parallelism, else None
        pos = global_position_ids(idx)
        if targets is not None and self.tile_tokens:  # no logits: hidden states, tiled head
            hidden = self.hf.base_model(input_ids=idx, use_cache=False, position_ids=pos)[0]
            return self.head_loss(hidden, self.hf.get_output_embeddings(), targets)
        out = self.hf(input_ids=idx, use_cache=False, position_ids=pos)
        loss = lm_loss(out.logits, targets)
        # a MoE whose config.json sets output_router_logits: transformers' balancing loss
        aux = getattr(out, "aux_loss", None)
        if targets is not None and aux is not None and self.training:
            loss = loss + self.hf.config.router_aux_loss_coef * aux.to(loss.dtype)
        return loss


def build_hf(cfg: ModelConfig, hf_config: dict[str, Any] | None = None) -> HFCausalLM:
    """Randomly initialised model from `cfg.hf`'s config.json (or a given config dict, e.g.
    the one embedded in an export). Build under `torch.device("meta")` for sharded init;
    HF's `_init_weights(module)` then re-creates buffers such as rotary frequencies."""
    tf = transformers_module()
    if hf_config is None:
        assert cfg.hf is not None
        hf_config = read_hf_config(cfg.hf)
    conf = dict(hf_config)
    model_type = conf.pop("model_type", None)
    if model_type is None:
        raise ConfigError(f"model.hf config.json has no model_type ({cfg.hf}); it must come "
                          "from a Hugging Face model (save_pretrained writes it)")
    try:
        hf_cfg = tf.AutoConfig.for_model(model_type, **conf)
        model = tf.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"model.hf: transformers cannot build '{model_type}' as a causal "
                          f"LM: {e}") from None
    if cfg.moe is not None and cfg.moe.expert_parallel > 1:  # models/hf_experts.py
        swap_hf_experts(model, cfg.moe.expert_parallel)
    return HFCausalLM(model, cfg, hf_config)


def plan(model: HFCausalLM) -> Plan:
    """The HF model's largest layer list are the units; its input/output embeddings the edge."""
    hf = model.hf
    blocks = largest_module_list(hf)
    edge = [m for m in hf.modules() if isinstance(m, nn.Embedding)]
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if isinstance(head, nn.Module):
        edge.append(head)
    p = plan_from(model, list(blocks) if blocks is not None else [], edge)
    # built on the meta device for sharded loading: HF's own initialiser remakes buffers
    # such as rotary frequencies
    init_buffers = getattr(hf, "_init_weights", None)
    return dataclasses.replace(p, init_buffers=init_buffers)
