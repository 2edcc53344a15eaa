"""Models, and the plan beside each: which modules are ZeRO-3 units, which optimizer
group each parameter belongs to.

`build_model(model_cfg)` builds the family the config names (the reference GPT, the
llama family, or any Hugging Face causal LM from `model.hf`); `pretrained_weights` binds
the weights it starts from, readable slice by slice; `plan_for(model)` returns the plan a
model family registered in `PLANS`, or `default_plan(model)` for any other `nn.Module`.
Plain exports carry their model config in the safetensors metadata (`export_metadata`),
so `load_export(file)` rebuilds the model from the file alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerotrain.config import ModelConfig
from zerotrain.models import gpt, hf, llama
from zerotrain.models.hf_export import hf_name
from zerotrain.models.plan import Group, Plan, default_plan
from zerotrain.models.presets import PRESETS, count_params, resolve_model_config
from zerotrain.models.weights import SafetensorsIndex, WeightError, Weights, bind

#: model class -> its plan function (written beside the model)
PLANS: dict[type, Callable[[nn.Module], Plan]] = {
    gpt.GPT: gpt.plan, llama.Llama: llama.plan, hf.HFCausalLM: hf.plan}  # type: ignore[dict-item]

EXPORT_FORMAT = "zerotrain-export"


def plan_for(model: nn.Module) -> Plan:
    fn = PLANS.get(type(model))
    return fn(model) if fn is not None else default_plan(model)


def build_model(model_cfg: ModelConfig, device: torch.device | str | None = None,
                hf_config: dict[str, Any] | None = None) -> nn.Module:
    """A randomly initialised model of the configured family, built on `device` (use
    "meta" to allocate nothing; the caller materialises it). `hf_config` stands in for
    model.hf's config.json (an export embeds it)."""
    cfg = resolve_model_config(model_cfg, hf_config=hf_config)
    with torch.device(device) if device is not None else nullcontext():
        if cfg.hf is not None:
            return hf.build_hf(cfg, hf_config)
        return gpt.GPT(cfg) if cfg.arch == "gpt" else llama.Llama(cfg)


def pretrained_weights(model_cfg: ModelConfig, model: nn.Module) -> Weights | None:
    """The weights the model starts from, bound to its parameter names: model.init_from,
    else model.hf's folder when it holds safetensors; None means random initialisation.

    A parameter is looked up under its own name (a zerotrain export) and then under its
    Hugging Face name (a folder written by `save_hf` or by transformers; GPT-2's Conv1D
    weights are read transposed). Binding checks every name and shape, reading nothing."""
    model_cfg = resolve_model_config(model_cfg)
    path = model_cfg.init_from
    if path is None and model_cfg.hf is not None and hf.has_weights(model_cfg.hf):
        path = model_cfg.hf
    if path is None:
        return None
    index = SafetensorsIndex(path)
    arch = None if model_cfg.hf is not None else model_cfg.arch

    def candidates(name: str) -> list[tuple[str, bool]]:
        return [(name, False), hf_name(arch, name)]

    return Weights(index, bind(model, index, candidates))


def export_metadata(model_cfg: ModelConfig, hf_config: dict[str, Any] | None = None,
                    **extra: Any) -> dict[str, str]:
    """safetensors metadata that makes a plain export self-describing: the resolved model
    config (JSON), model.hf's config.json when there is one, and any extra strings."""
    cfg = resolve_model_config(model_cfg, hf_config=hf_config)
    meta = {"format": EXPORT_FORMAT, "model_config": json.dumps(cfg.model_dump(mode="json"))}
    if cfg.hf is not None:
        meta["hf_config"] = json.dumps(hf_config if hf_config is not None
                                       else hf.read_hf_config(cfg.hf))
    meta.update({k: str(v) for k, v in extra.items()})
    return meta


def load_export(path: str | Path, device: torch.device | str | None = None
                ) -> tuple[nn.Module, dict[str, str]]:
    """Rebuild the model of a plain export from the file alone; returns (model, metadata)."""
    index = SafetensorsIndex(path)
    if "model_config" not in index.metadata:
        raise WeightError(f"'{path}' carries no model config in its metadata (written by an "
                          "older zerotrain?); export the checkpoint again")
    cfg = ModelConfig.model_validate(json.loads(index.metadata["model_config"]))
    hf_config = json.loads(index.metadata["hf_config"]) if "hf_config" in index.metadata else None
    model = build_model(cfg, device, hf_config)
    Weights(index, bind(model, index)).load_into(model)
    return model, index.metadata


__all__ = ["EXPORT_FORMAT", "PLANS", "PRESETS", "Group", "Plan", "WeightError", "Weights",
           "build_model", "count_params", "default_plan", "export_metadata", "load_export",
           "plan_for", "pretrained_weights", "resolve_model_config"]
