"""Reading configs: files (YAML, JSON; a key given twice is refused), command-line
overrides, library defaults, and one ConfigError naming the field and the fix."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from zerotrain.config.base import ConfigError
from zerotrain.config.tree import Config

# ----------------------------------------------------------------------------- loading


def _suggest(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    return f" — did you mean '{close[0]}'?" if close else f" (valid keys: {', '.join(options)})"


def _section(ann: Any) -> type[BaseModel] | None:
    """The section model of a field (also an optional one: `MoEConfig | None`)."""
    for a in (ann, *get_args(ann)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _check_keys(data: Any, model: type[BaseModel], prefix: str = "") -> None:
    """Reject unknown keys with a 'did you mean' hint before pydantic sees them."""
    if not isinstance(data, dict):
        return
    fields = model.model_fields
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            options = [f"{prefix}{k}" for k in fields]
            home = [f"{k}.{key}" for k, f in fields.items()
                    if key in getattr(_section(f.annotation), "model_fields", {})]
            hint = f" — it lives in a section: '{home[0]}'" if home and not prefix \
                else _suggest(dotted, options)
            raise ConfigError(f"unknown config key '{dotted}'{hint}")
        ann = _section(fields[key].annotation) or fields[key].annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            if value is None and fields[key].default is None:  # an optional section, off
                continue
            if not isinstance(value, dict):
                raise ConfigError(
                    f"config key '{dotted}' is a section; give it as a mapping of "
                    f"{', '.join(ann.model_fields)}"
                )
            _check_keys(value, ann, dotted + ".")


def _format_validation(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-"))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "value_error" or not loc:
            lines.append(msg)
        else:
            lines.append(f"config field '{loc}': {msg} (got {e.get('input')!r})")
    return "; ".join(lines)


#: Defaults of a library user (`zerotrain.initialize(model, cfg)`) that differ from the
#: command line's: a DeepSpeed or plain-PyTorch user who configures no schedule expects
#: the optimizer's lr, constant, from the first step. Anything the user sets still wins.
LIBRARY_DEFAULTS: dict[str, Any] = {
    "schedule": {"kind": "constant", "warmup_steps": 0, "min_lr": 0.0},
}


def build_config(data: dict[str, Any] | None = None, *, library: bool = False) -> Config:
    """Validate a nested dict into a Config, raising ConfigError on any problem.

    library=True starts from LIBRARY_DEFAULTS (constant lr) instead of the CLI defaults.
    """
    data = data or {}
    _check_keys(data, Config)
    if library:
        data = deep_merge(LIBRARY_DEFAULTS, data)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e)) from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup is not None:
        raise ValueError(f"key '{dup}' appears twice in one object")
    return dict(pairs)


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice (YAML itself keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' appears twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_config_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist; pass an existing .yaml or .json")
    try:
        text = p.read_text()
        data = (json.loads(text, object_pairs_hook=_unique_keys) if p.suffix == ".json"
                else yaml.load(text, Loader=_StrictLoader))
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"config file '{p}' could not be parsed: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping of sections at the top level")
    return data


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ['--optimizer.lr', '3e-4', '--zero.stage=2'] into a nested dict."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("--") or len(tok) <= 2:
            raise ConfigError(
                f"unexpected argument '{tok}'; overrides look like --section.key VALUE")
        body = tok[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override '{tok}' has no value; write {tok} VALUE")
            key, raw = body, args[i + 1]
            i += 2
        key = key.replace("-", "_")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{tok}' conflicts with an earlier value for '{part}'")
        node[parts[-1]] = value
    return out


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = deep_merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def load_config(path: str | Path | None = None,
                overrides: list[str] | dict | None = None, *, library: bool = False) -> Config:
    data = read_config_file(path) if path else {}
    if overrides:
        extra = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        data = deep_merge(data, extra)
    return build_config(data, library=library)
