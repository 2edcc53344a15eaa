"""Reading a DeepSpeed dict: typed values, "auto", and a verdict on every key left over.

Every read marks its dotted key as used. Whatever no mapping read is judged at the end
against the lists in `keys.py`; problems and notes collect, so that one error can name
all of a file's problems at once.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from pydantic import TypeAdapter, ValidationError

from zerotrain.config import Config
from zerotrain.deepspeed_config.keys import FEATURES, IGNORED, MAPPED, ONLY_DEFAULT, UNIMPLEMENTED

_MISSING = object()


class Reader:
    """A DeepSpeed dict being mapped, with zerotrain overrides to resolve "auto" from."""

    def __init__(self, data: dict[str, Any], overrides: dict[str, Any]):
        self.data, self.overrides = data, overrides
        self.used: set[str] = set()
        self.problems: list[str] = []
        self.notes: list[str] = []
        self._defaults = Config()

    def raw(self, path: str, default: Any = _MISSING) -> Any:
        node: Any = self.data
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        self.used.add(path)
        return node

    def is_auto(self, path: str) -> bool:
        return self.raw(path, None) == "auto"

    def zt(self, zpath: str) -> Any:
        """zerotrain's value for a field: the override given, else zerotrain's default."""
        node: Any = self.overrides
        for part in zpath.split("."):
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        model: Any = Config
        for part in zpath.split(".")[:-1]:
            model = model.model_fields[part].annotation
        if node is not _MISSING:  # coerced as the field would be ("5e-5" from a CLI is a str)
            try:
                node = TypeAdapter(model.model_fields[zpath.split(".")[-1]].annotation
                                   ).validate_python(node)
            except ValidationError:
                return node  # build_config will name it
        else:
            node = self._defaults
            for part in zpath.split("."):
                node = getattr(node, part)
        return list(node) if isinstance(node, tuple) else node

    def problem(self, path: str, msg: str) -> None:
        v = self.raw(path, _MISSING)
        shown = f"{path}={json.dumps(v)}" if v is not _MISSING and not isinstance(v, dict) \
            else path
        self.problems.append(f"{shown}: {msg}")

    def get(self, path: str, default: Any, kind: type = float, auto: str | None = None) -> Any:
        """A typed value: absent -> `default` (DeepSpeed's); "auto" -> zerotrain's `auto`
        field (or a problem when there is none); a wrong type -> a problem and `default`."""
        v = self.raw(path, _MISSING)
        if v is _MISSING:
            return default
        if v == "auto":
            if auto is None:
                self.problem(path, "'auto' has no zerotrain value to resolve to; give a value")
                return default
            value = self.zt(auto)
            self.notes.append(f"{path}: auto -> {value!r} (zerotrain's {auto})")
            return value
        ok = _typed(v, kind)
        if ok is _MISSING:
            self.problem(path, f"must be {_KIND_NAMES[kind]}")
            return default
        return ok

    def leftovers(self) -> None:
        """Judge every key no mapping read: fine at DeepSpeed's default, a note, or a problem."""
        for top, why in FEATURES.items():  # optional features: judged whole, by `enabled`
            if top not in self.data:
                continue
            if _enabled(self.data[top]):
                if top in IGNORED:
                    self.notes.append(f"{top}: ignored ({IGNORED[top]})")
                else:
                    self.problem(f"{top}.enabled", f"{why}; remove '{top}' or disable it")
            self.used.update(path for path, _ in leaves({top: self.data[top]}))
        for path, value in leaves(self.data):
            if path in self.used or value == {}:  # an empty section configures nothing
                continue
            if path in ONLY_DEFAULT:
                default, why = ONLY_DEFAULT[path]
                if value != default and value != "auto":
                    self.problem(path, f"zerotrain supports only DeepSpeed's default "
                                       f"{json.dumps(default)}: {why}")
                continue
            reason = _ignored_reason(path)
            if reason is not None:
                self.notes.append(f"{path}: ignored ({reason})")
            elif path in MAPPED and path.split(".")[1] == "params":  # another type's
                section = path.split(".")[0]
                self.problem(path, f"not a parameter of {section} type "
                                   f"{self.data[section].get('type')} as zerotrain maps it")
            elif _unimplemented(path) is not None:
                self.problem(path, "a DeepSpeed setting zerotrain does not implement: "
                             + str(_unimplemented(path)))
            else:
                self.problem(path, "not a DeepSpeed setting zerotrain maps"
                             + _suggest(path, self.used))


def _unimplemented(path: str) -> str | None:
    """Why a real DeepSpeed setting has no zerotrain counterpart, or None."""
    for prefix, why in UNIMPLEMENTED.items():
        if path == prefix or path.startswith(prefix + "."):
            return why
    return None


_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _typed(v: Any, kind: type) -> Any:
    if kind is bool:
        return v if isinstance(v, bool) else _MISSING
    if kind is str:
        return v if isinstance(v, str) else _MISSING
    if isinstance(v, bool) or not isinstance(v, int | float):
        return _MISSING
    if kind is int:
        return int(v) if float(v).is_integer() else _MISSING
    return float(v)


def leaves(d: dict[str, Any], prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _enabled(section: Any) -> bool:
    on = section.get("enabled") if isinstance(section, dict) else section
    return on not in (None, False, 0)


def _ignored_reason(path: str) -> str | None:
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        reason = IGNORED.get(".".join(parts[:i]))
        if reason is not None:
            return reason
    return None


def _suggest(path: str, used: set[str]) -> str:
    """A close known key for the first part of `path` that no known key has."""
    known = [k.split(".") for k in (*ONLY_DEFAULT, *IGNORED, *MAPPED, *FEATURES, *used)]
    parts = path.split(".")
    for i in range(len(parts)):
        children = {k[i] for k in known if len(k) > i and k[:i] == parts[:i]}
        if parts[i] not in children:
            close = difflib.get_close_matches(parts[i], sorted(children), n=1, cutoff=0.75)
            return f" — did you mean '{'.'.join([*parts[:i], close[0]])}'?" if close else ""
    return ""
