"""Reading a DeepSpeed dict: typed values, "auto", and a verdict on every key left over.

Every read marks its dotted key as used. Whatever no mapping read is judged at the end
against the lists in `keys.py`; problems and notes collect, so that one error can name
all of a file's problems at once.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from zerotrain.config import Config
from zerotrain.deepspeed_config.keys import FEATURES, IGNORED, KNOWN_TOP, ONLY_DEFAULT

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
        if node is not _MISSING:
            return node
        obj: Any = self._defaults
        for part in zpath.split("."):
            obj = getattr(obj, part)
        return list(obj) if isinstance(obj, tuple) else obj

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
            if path in self.used:
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
            else:
                self.problem(path, "not a DeepSpeed setting zerotrain maps" + _suggest(path))


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


def _suggest(path: str) -> str:
    *parent, leaf = path.split(".")
    pre = ".".join(parent) + "." if parent else ""
    known = {p.split(".")[len(parent)] for p in (*ONLY_DEFAULT, *IGNORED, *KNOWN_TOP)
             if p.startswith(pre) and p.count(".") >= len(parent)}
    close = difflib.get_close_matches(leaf, sorted(known), n=1, cutoff=0.75)
    return f" — did you mean '{pre}{close[0]}'?" if close else ""
