"""Named model sizes, and turning a `ModelConfig` into a fully resolved one.

A preset fills the size fields the user left null (`model.n_layer` etc.); anything the
user set wins. The family's defaults for the rest (bias, tied head, MLP width) then come
from `config.ModelConfig`'s one rule. Parameter counts below are computed by
`count_params` (and checked in tests against the built model), for the vocabulary in
brackets: the real vocabulary follows the tokenizer.
"""

from __future__ import annotations

import difflib
from typing import Any

from zerotrain.config import ConfigError, ModelConfig, llama_intermediate_size
from zerotrain.config.model import read_hf_config

#: name -> (family, sizes). Parameters (count_params; a gpt's tied head counts once):
#:   preset       GPT-2/Llama vocab          bytes (V 256, block_size 128)
#:   gpt-tiny       7.36M (V 50,304, T 1024)   0.84M
#:   gpt-mini      30.36M                     10.80M
#:   gpt-small    124.48M  (GPT-2 small)      85.35M
#:   gpt-medium   354.87M  (GPT-2 medium)    302.70M
#:   llama-tiny     8.98M (V 32,000)           0.85M
#:   llama-60m     58.07M                     25.57M
#:   llama-125m   134.11M                     85.35M
#:   llama-350m   367.97M                    302.96M
#:   llama-1b    1100.05M  (TinyLlama-1.1B's shape: 1,100,048,384 exactly)
#:   llama-moe-tiny 10.75M, 8.98M active       2.63M, 0.86M active
#:                (llama-tiny with 8 experts of half its MLP width, top-2: the dense
#:                model's active size plus the routers; `active_params` counts it)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt-tiny": ("gpt", {"n_layer": 4, "n_head": 4, "n_embd": 128}),
    "gpt-mini": ("gpt", {"n_layer": 6, "n_head": 6, "n_embd": 384}),
    "gpt-small": ("gpt", {"n_layer": 12, "n_head": 12, "n_embd": 768}),
    "gpt-medium": ("gpt", {"n_layer": 24, "n_head": 16, "n_embd": 1024}),
    "llama-tiny": ("llama", {"n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 128}),
    "llama-60m": ("llama", {"n_layer": 8, "n_head": 8, "n_embd": 512, "intermediate_size": 1376}),
    "llama-125m": ("llama", {"n_layer": 12, "n_head": 12, "n_embd": 768,
                             "intermediate_size": 2048}),
    "llama-350m": ("llama", {"n_layer": 24, "n_head": 16, "n_embd": 1024,
                             "intermediate_size": 2736}),
    "llama-1b": ("llama", {"n_layer": 22, "n_head": 32, "n_kv_head": 4, "n_embd": 2048,
                           "intermediate_size": 5632}),
    "llama-moe-tiny": ("llama", {"n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 128,
                                 "intermediate_size": 192, "moe": {"experts": 8, "top_k": 2}}),
}


def preset_sizes(name: str, arch: str | None = None) -> tuple[str, dict[str, Any]]:
    """(family, size fields) of a preset; one clear error for an unknown or foreign name."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'?" if close else f"choose one of {', '.join(PRESETS)}"
        raise ConfigError(f"unknown model.preset '{name}'; {hint}")
    family, sizes = PRESETS[name]
    if arch is not None and arch != family:
        same = [n for n, (f, _) in PRESETS.items() if f == arch]
        raise ConfigError(f"model.preset '{name}' is a {family} size but model.arch is {arch}; "
                          f"use a {arch} preset ({', '.join(same)}) or set model.arch {family}")
    return family, dict(sizes)


def _hf_sizes(raw: dict[str, Any]) -> dict[str, Any]:
    """Size fields of a Hugging Face config under zerotrain's names (for the record and
    the estimator: the HF model itself is built from the config)."""

    def pick(*keys: str) -> Any:
        return next((raw[k] for k in keys if raw.get(k) is not None), None)

    return {"n_layer": pick("num_hidden_layers", "n_layer"),
            "n_head": pick("num_attention_heads", "n_head"),
            "n_embd": pick("hidden_size", "n_embd", "d_model"),
            "vocab_size": pick("vocab_size"),
            "max_positions": pick("max_position_embeddings", "n_positions")}


def _check_vocab(cfg: dict[str, Any], user_set: bool, vocab: int, source: str) -> None:
    if not user_set:
        cfg["vocab_size"] = vocab
    elif cfg["vocab_size"] < vocab:
        raise ConfigError(f"model.vocab_size {cfg['vocab_size']} is smaller than the "
                          f"{source}'s {vocab} tokens; remove model.vocab_size (it follows "
                          f"the {source}) or raise it to at least {vocab}")


def resolve_model_config(cfg: ModelConfig, tokenizer_vocab: int | None = None,
                         hf_config: dict[str, Any] | None = None) -> ModelConfig:
    """Every field concrete: preset sizes where the user left them null, family defaults,
    `model.hf`'s sizes, and the vocabulary of the tokenizer unless model.vocab_size was set
    (a model vocabulary smaller than the tokenizer's is one error; larger is padding).
    Idempotent, so resolving a resolved config (a checkpoint's) changes nothing.
    `hf_config`: model.hf's config.json when it is at hand (else read from the folder)."""
    d = cfg.model_dump()
    vocab_set = "vocab_size" in cfg.model_fields_set
    if cfg.hf is not None:
        hf = _hf_sizes(hf_config if hf_config is not None else read_hf_config(cfg.hf))
        for k in ("n_layer", "n_head", "n_embd"):
            if d[k] is not None and hf[k] is not None and d[k] != hf[k]:
                raise ConfigError(f"model.{k} = {d[k]} but model.hf's config.json says "
                                  f"{hf[k]}; remove model.{k} (model.hf sets the sizes)")
            d[k] = hf[k] if hf[k] is not None else d[k]
        if hf["max_positions"] and cfg.block_size > hf["max_positions"]:
            raise ConfigError(f"model.block_size {cfg.block_size} exceeds model.hf's "
                              f"{hf['max_positions']} positions; lower model.block_size")
        if hf["vocab_size"]:
            _check_vocab(d, vocab_set, hf["vocab_size"], "model.hf config")
            vocab_set = True
    elif cfg.preset is not None:
        family, sizes = preset_sizes(cfg.preset, cfg.arch)
        d["arch"] = family
        for k, v in sizes.items():
            if k == "moe":  # the preset's experts, under any model.moe.* the user set
                mine = cfg.moe.model_dump(include=cfg.moe.model_fields_set) if cfg.moe else {}
                d[k] = {**v, **mine}
            else:
                d[k] = v if d[k] is None else d[k]
    if tokenizer_vocab is not None:
        _check_vocab(d, vocab_set, tokenizer_vocab, "tokenizer")
        vocab_set = True
    if not vocab_set:
        d.pop("vocab_size")  # keep "not set by the user" visible to a later tokenizer
    return ModelConfig.model_validate(d)


def tokenizer_vocab(spec: str) -> int | None:
    """The vocabulary a run's data.tokenizer will have, found without data: bytes 256,
    bpe:N at most N (a corpus short of merges gives fewer), a file or folder its own;
    None when the tokenizer cannot be read (the run itself then says why)."""
    if spec == "bytes":
        return 256
    if spec.startswith("bpe:"):
        return int(spec[4:])
    from zerotrain.data.errors import DataError
    from zerotrain.data.tokenizer import load_tokenizer

    try:
        return load_tokenizer(spec).vocab_size
    except DataError:
        return None


def planned_model_config(model: ModelConfig, tokenizer: str = "bytes") -> ModelConfig:
    """The model a run will build (`resolve_model_config`), before any data is read: what
    `estimate --model` counts and `config show` prints. A model vocabulary smaller than
    the tokenizer's is the run's error to report; here the model's own sizes stand."""
    try:
        return resolve_model_config(model, tokenizer_vocab=tokenizer_vocab(tokenizer))
    except ConfigError:
        return resolve_model_config(model)


def count_params(cfg: ModelConfig, active: bool = False) -> int:
    """Unique parameters of a gpt or llama config, from the shapes alone (a tied head
    counts once); `active`: a MoE's top_k experts only. Tests hold it against the built
    model."""
    c = resolve_model_config(cfg)
    if c.hf is not None:
        raise ConfigError("count_params needs model.arch gpt or llama; for model.hf build the "
                          "model on the meta device and count its parameters")
    d, V, L = c.n_embd, c.vocab_size, c.n_layer
    assert d is not None and L is not None and c.n_head is not None
    head = 0 if c.tie_weights else V * d
    if c.arch == "gpt":
        inner = c.mlp_ratio * d
        b = 1 if c.bias else 0
        block = 4 * d * d + 2 * d * inner + b * (3 * d + d + inner + d) + 2 * d * (1 + b)
        return V * d + c.block_size * d + L * block + d * (1 + b) + head
    hd = d // c.n_head
    kv = (c.n_kv_head or c.n_head) * hd
    inner = c.intermediate_size or llama_intermediate_size(d)
    experts = (c.moe.top_k if active else c.moe.experts) if c.moe else 1
    router = d * c.moe.experts if c.moe else 0
    block = 2 * d * d + 2 * d * kv + experts * 3 * d * inner + router + 2 * d
    if c.bias:  # q, k, v, o and the three MLP projections
        block += d + 2 * kv + d + 2 * inner + d
    return V * d + L * block + d + head


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token's forward uses: a MoE counts top_k experts per layer (and the
    router), a dense model all of them."""
    return count_params(cfg, active=True)
