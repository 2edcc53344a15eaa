"""Models, and the plan beside each: which modules are ZeRO-3 units, which optimizer
group each parameter belongs to.

`build_model(model_cfg)` builds the family the config names (the reference GPT, the
llama family, or any Hugging Face causal LM from `model.hf`); `pretrained_weights` binds
the weights it starts from, readable slice by slice; `plan_for(model)` returns the plan a
model family registered in `PLANS`, or `default_plan(model)` for any other `nn.Module`.
Plain exports carry their model config in the safetensors metadata (`export_metadata`),
so `load_export(file)` rebuilds the model from the file alone. `count_params` counts on
the meta device; the per-unit sizes ZeRO-3's cut makes (`unit_numels`, `model_size`) are
zero/cut.py's, beside the cut rule itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerotrain.config import ModelConfig
from zerotrain.memory.activations import moe_shape
from zerotrain.models import gpt, hf, llama, presets
from zerotrain.models.hf_convert import ConvertedIndex
from zerotrain.models.hf_export import hf_name, hf_twin
from zerotrain.models.moe import active_numel
from zerotrain.models.moe_parallel import one_process_whole
from zerotrain.models.plan import Group, Plan, default_plan
from zerotrain.models.presets import PRESETS, resolve_model_config
from zerotrain.models.weights import SafetensorsIndex, WeightError, Weights, bind

#: model class -> its plan function (written beside the model)
PLANS: dict[type, Callable[[nn.Module], Plan]] = {
    gpt.GPT: gpt.plan, llama.Llama: llama.plan, hf.HFCausalLM: hf.plan}  # type: ignore[dict-item]

EXPORT_FORMAT = "zerotrain-export"


def plan_for(model: nn.Module) -> Plan:
    fn = PLANS.get(type(model))
    return fn(model) if fn is not None else default_plan(model)


def on_meta(model_or_factory: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    """The model itself, or the factory's model built on the meta device (shapes only:
    a 70B model costs no memory to count)."""
    if isinstance(model_or_factory, nn.Module):
        return model_or_factory
    with torch.device("meta"):
        return model_or_factory()


def count_params(model: ModelConfig | nn.Module | Callable[[], nn.Module]) -> int:
    """Unique parameter elements; tied weights count once (parameters() de-duplicates).

    A config of the gpt/llama families is counted by formula (`presets.count_params`,
    held against built models in the tests); anything else is built on the meta device.
    """
    if isinstance(model, ModelConfig):
        cfg = resolve_model_config(model)
        if cfg.hf is None:
            return presets.count_params(cfg)
        model = on_meta(lambda: build_model(cfg))
    return sum(p.numel() for p in on_meta(model).parameters())


def active_param_count(model_cfg: ModelConfig) -> int:
    """Parameters one token's forward uses: a MoE (`model.moe`, or a model.hf MoE by its
    config.json) counts its top_k experts per layer, a dense model everything."""
    cfg = resolve_model_config(model_cfg)
    if cfg.hf is None:
        return presets.active_params(cfg)
    experts, top_k, _ = moe_shape(hf.read_hf_config(cfg.hf))
    if cfg.moe is not None:  # every expert, whatever the expert-parallel degree
        cfg = cfg.model_copy(update={"moe": cfg.moe.model_copy(update={"expert_parallel": 1})})
    model = on_meta(lambda: build_model(cfg))
    return active_numel(model, experts, top_k) if experts else count_params(model)


def build_model(model_cfg: ModelConfig, device: torch.device | str | None = None,
                hf_config: dict[str, Any] | None = None) -> nn.Module:
    """A randomly initialised model of the configured family, built on `device` (use
    "meta" to allocate nothing; the caller materialises it). `hf_config` stands in for
    model.hf's config.json (an export embeds it)."""
    cfg = one_process_whole(resolve_model_config(model_cfg, hf_config=hf_config))
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
    arch = None if model_cfg.hf is not None else model_cfg.arch

    def candidates(name: str) -> list[tuple[str, bool]]:
        return [(name, False), hf_name(arch, name)]

    with _naming(model_cfg):
        index: Any = open_weights(path)
        if index.metadata.get("format") != EXPORT_FORMAT:
            # the Hub's on-disk names (per-expert MoE tensors) -> the in-memory ones
            twin = model.hf if isinstance(model, hf.HFCausalLM) else \
                hf_twin(model_cfg) if model_cfg.moe is not None else None
            if twin is not None:
                index = ConvertedIndex(index, twin)
        return Weights(index, bind(model, index, candidates))


@contextmanager
def _naming(model_cfg: ModelConfig) -> Iterator[None]:
    """Weight errors name the setting that pointed at the weights."""
    try:
        yield
    except WeightError as e:
        what = "model.init_from" if model_cfg.init_from is not None else "model.hf"
        raise WeightError(f"{what}: {e}") from None


def open_weights(path: str | Path) -> SafetensorsIndex:
    """The safetensors index of model.init_from / model.hf's folder; a training checkpoint
    or run folder (which hold sharded training state, not weights) is named as such."""
    p = Path(path).expanduser()
    if p.is_dir() and any((p / m).exists() for m in ("meta.json", "latest", "checkpoints")):
        raise WeightError(
            f"'{p}' is a training checkpoint or run folder, not exported weights; continue "
            f"that run with --resume {p}, or export its weights with `zerotrain export "
            f"{p} --out W.safetensors` and start from W")
    return SafetensorsIndex(p)


def check_weights(model_cfg: ModelConfig) -> None:
    """Before launching ranks: model.init_from names readable weights (headers only)."""
    if model_cfg.init_from is not None:
        with _naming(model_cfg):
            open_weights(model_cfg.init_from).close()


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
           "active_param_count", "build_model", "check_weights", "count_params",
           "default_plan", "export_metadata", "load_export", "on_meta", "plan_for",
           "pretrained_weights", "resolve_model_config"]
