"""DeepSpeed JSON configs, read as zerotrain configs.

`from_deepspeed(ds, world_size)` maps a DeepSpeed config (a dict, or the path of its
JSON file) onto a zerotrain config dict for `build_config`; `load_deepspeed_config`
does both, `load_any_config` tells the two kinds of config apart (for
`zerotrain.initialize(model, "ds_config.json")`), and `deepspeed_to_yaml` writes the
result for `zerotrain config from-deepspeed ds.json`.

A DeepSpeed key means what it means in DeepSpeed, defaults included: an absent key
takes DeepSpeed's default, not zerotrain's. Nothing is dropped silently:
- a setting zerotrain cannot honour is a problem, and all problems of a file are
  raised together, in one ConfigError that names each dotted key;
- a setting that only tunes DeepSpeed's own speed or memory (all-gather bucket sizes,
  pinned buffers, ...) is accepted and named in the mapping's `notes`;
- "auto" (Hugging Face's placeholder) takes zerotrain's value for the field: the
  override given, else zerotrain's default (also named in `notes`).
Files: `reader.py` (typed reads, "auto", the verdict on left-over keys), `keys.py`
(what unmapped DeepSpeed keys mean here), `sections.py` (batch, precision, ZeRO,
monitors), `optim.py` (optimizer and scheduler).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from zerotrain.config import (
    Config,
    ConfigError,
    build_config,
    deep_merge,
    parse_overrides,
    read_config_file,
)
from zerotrain.deepspeed_config import sections
from zerotrain.deepspeed_config.keys import KNOWN_TOP
from zerotrain.deepspeed_config.optim import map_optimizer, map_scheduler
from zerotrain.deepspeed_config.reader import Reader

__all__ = ["DeepSpeedMapping", "deepspeed_to_yaml", "from_deepspeed", "load_any_config",
           "load_deepspeed_config", "looks_like_deepspeed", "map_deepspeed", "read_deepspeed"]


@dataclass
class DeepSpeedMapping:
    """A DeepSpeed config read as zerotrain's: the config dict and what was noted on the way."""

    config: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    world_size: int = 1
    world_size_used: bool = False  # whether the batch triple needed the world size
    source: str = "<dict>"


def read_deepspeed(ds: dict[str, Any] | str | Path) -> tuple[dict[str, Any], str]:
    """(the DeepSpeed dict, how to name it in messages) from a dict or a JSON file path."""
    if isinstance(ds, dict):
        return ds, "<dict>"
    p = Path(ds)
    if not p.is_file():
        raise ConfigError(f"DeepSpeed config '{p}' does not exist; pass the path of its .json")
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"DeepSpeed config '{p}' is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config '{p}' must hold a JSON object at the top level")
    return data, f"'{p}'"


def _world(world_size: int | None) -> int:
    if world_size is not None:
        if world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {world_size}")
        return world_size
    return int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's, else one process


def map_deepspeed(ds: dict[str, Any] | str | Path, world_size: int | None = None,
                  overrides: dict[str, Any] | list[str] | None = None,
                  label: str | None = None) -> DeepSpeedMapping:
    """Map a DeepSpeed config; raise one ConfigError listing every key zerotrain cannot honour.

    world_size: the number of ranks (default: $WORLD_SIZE, else 1), needed when
    train_batch_size is one of the two batch sizes given. overrides: zerotrain settings
    (a nested dict, or ['--section.key', 'value', ...]) that win over the mapping and
    resolve "auto" values.
    """
    data, read_label = read_deepspeed(ds)
    label = label or read_label  # a dict read from a file elsewhere keeps the file's name
    extra = parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides or {})
    world = _world(world_size)
    r = Reader(data, extra)
    out: dict[str, Any] = {}
    used_world = sections.batch(r, world, out)
    dtype = sections.precision(r, out)
    reduce_bytes = 4 if out["precision"]["reduce_dtype"] == "fp32" or dtype == "fp32" else 2
    sections.zero(r, out, reduce_bytes)
    opt = map_optimizer(r) or {}
    sched, peak, steps = map_scheduler(r, opt.get("lr", r.zt("optimizer.lr")))
    opt["lr"] = peak
    opt["grad_clip"] = r.get("gradient_clipping", 1.0, auto="optimizer.grad_clip")
    opt.update(sections.compact_states(r, out))
    out["optimizer"] = opt
    if sched:
        out["schedule"] = sched
    if steps is not None:
        out["train"] = {"steps": steps}
    sections.monitors(r, out)
    r.leftovers()
    if r.problems:
        raise ConfigError(f"DeepSpeed config {label}: {len(r.problems)} setting(s) zerotrain "
                          f"cannot honour: " + "; ".join(r.problems))
    return DeepSpeedMapping(deep_merge(out, extra), r.notes, world, used_world, label)


def from_deepspeed(ds: dict[str, Any] | str | Path, world_size: int | None = None,
                   overrides: dict[str, Any] | list[str] | None = None) -> dict[str, Any]:
    """The zerotrain config dict for a DeepSpeed config (validate it with build_config)."""
    return map_deepspeed(ds, world_size, overrides).config


def load_deepspeed_config(ds: dict[str, Any] | str | Path, world_size: int | None = None,
                          overrides: dict[str, Any] | list[str] | None = None,
                          label: str | None = None) -> Config:
    """from_deepspeed, validated: the Config `zerotrain train --deepspeed ds.json` runs.
    `label`: how messages name a dict `ds` (the file it was read from)."""
    m = map_deepspeed(ds, world_size, overrides, label)
    try:
        return build_config(m.config)
    except ConfigError as e:
        raise ConfigError(f"DeepSpeed config {m.source} maps to an invalid zerotrain config: "
                          f"{e}") from None


def deepspeed_to_yaml(path: str | Path, world_size: int | None = None,
                      overrides: dict[str, Any] | list[str] | None = None) -> str:
    """The YAML `zerotrain config from-deepspeed ds.json` prints: the mapped sections, with
    the source, the world size when it mattered, and every note as comments."""
    m = map_deepspeed(path, world_size, overrides)
    load_deepspeed_config(path, world_size, overrides)  # the same errors as training would
    head = [f"# zerotrain config mapped from DeepSpeed config {m.source}"]
    if m.world_size_used:
        sp = m.config.get("sequence", {}).get("parallel", 1)
        dp = "world size" if sp in (1, None) else f"world size / sequence.parallel {sp}"
        head.append(f"# world size {m.world_size} (train_batch_size = micro batch × "
                    f"accumulation × {dp})")
    head += [f"#   note: {n}" for n in m.notes]
    order = list(Config.model_fields)
    ordered = {k: m.config[k] for k in sorted(m.config, key=order.index)}
    return "\n".join(head) + "\n" + yaml.safe_dump(ordered, sort_keys=False)


def looks_like_deepspeed(data: dict[str, Any]) -> bool:
    """Whether a config dict is DeepSpeed's: a DeepSpeed-only key, or a DeepSpeed-shaped
    `optimizer` ({type, params}); zerotrain's sections otherwise."""
    ours = set(Config.model_fields)
    if any(k not in ours and k in KNOWN_TOP for k in data):
        return True
    opt = data.get("optimizer")
    return isinstance(opt, dict) and ("type" in opt or "params" in opt)


def load_any_config(config: Config | dict[str, Any] | str | Path | None = None, *,
                    world_size: int | None = None,
                    overrides: dict[str, Any] | list[str] | None = None,
                    library: bool = True) -> Config:
    """A Config from whatever `zerotrain.initialize` is given: a Config, a zerotrain dict
    or YAML/JSON file, or a DeepSpeed dict or JSON file (told apart by their keys).
    library=True: zerotrain configs start from the library defaults (constant lr)."""
    if isinstance(config, Config):
        return config
    if isinstance(config, str | Path):
        p = Path(config)
        data = read_deepspeed(p)[0] if p.suffix == ".json" else read_config_file(p)
        if looks_like_deepspeed(data):
            return load_deepspeed_config(p, world_size, overrides)
    else:
        data = config or {}
        if looks_like_deepspeed(data):
            return load_deepspeed_config(data, world_size, overrides)
    extra = parse_overrides(overrides) if isinstance(overrides, list) else (overrides or {})
    return build_config(deep_merge(data, extra), library=library)
