"""Hyper-parameters per optimizer group of a model's plan (decay; Muon or its fallback)."""

from __future__ import annotations

from typing import Any

from zerotrain.config import Config
from zerotrain.models.plan import Group


def group_hyperparameters(cfg: Config) -> dict[int, dict[str, Any]]:
    """Per optimizer group: weight decay, and for Muon which path the group takes.

    Embeddings and the head are decayed but stay on Muon's AdamW fallback, as its
    authors recommend; biases and norm gains are decayed only with `decay_1d`.
    """
    wd = cfg.optimizer.weight_decay
    out: dict[int, dict[str, Any]] = {
        Group.MATRIX: {"weight_decay": wd},
        Group.VECTOR: {"weight_decay": wd if cfg.optimizer.decay_1d else 0.0},
        Group.EMBEDDING: {"weight_decay": wd},
    }
    if cfg.optimizer.name == "muon":  # None: Muon for 2-D tensors, AdamW otherwise
        out[Group.MATRIX]["use_muon"] = None
        # Newton–Schulz's fp32 GEMMs on TF32 tensor cores (CUDA only) in half-precision
        # runs, unless precision.tf32 is false; fp32 runs follow precision.tf32 globally
        p = cfg.precision
        out[Group.MATRIX]["ns_tf32"] = p.dtype != "fp32" and p.tf32 is not False
        out[Group.VECTOR]["use_muon"] = False
        out[Group.EMBEDDING]["use_muon"] = False
    return {int(g): h for g, h in out.items()}
