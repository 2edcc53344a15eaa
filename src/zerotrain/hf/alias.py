"""`import deepspeed` answered by `zerotrain.deepspeed`, inside this process only.

A finder placed first on `sys.meta_path` answers every module name `deepspeed` and
`deepspeed.*` with a stand-in module that forwards attribute reads to zerotrain's
module of the same meaning (`deepspeed.zero` -> `zerotrain.deepspeed.zero`, a few
renamed in `RENAMED`), and answers `importlib.metadata` for the distribution
`deepspeed` with DeepSpeed's version, which is what transformers and Accelerate check
(`is_deepspeed_available()`, `compare_versions("deepspeed", ...)`). Nothing is written
anywhere: a process that does not install the finder sees the machine as it is,
including a real DeepSpeed where one is installed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

#: the DeepSpeed release whose surface zerotrain.deepspeed follows
DEEPSPEED_VERSION = "0.19.8"

#: DeepSpeed module -> the zerotrain module that answers it, where the path differs
RENAMED: dict[str, str] = {
    "deepspeed": "zerotrain.deepspeed",
    "deepspeed.runtime.engine": "zerotrain.deepspeed.engine",
    "deepspeed.runtime.zero": "zerotrain.deepspeed.zero",
    "deepspeed.runtime.zero.partition_parameters": "zerotrain.deepspeed.zero",

    "deepspeed.runtime.lr_schedules": "zerotrain.deepspeed.runtime",
    "deepspeed.runtime.utils": "zerotrain.deepspeed.runtime",
    "deepspeed.checkpoint": "zerotrain.deepspeed.runtime",
    "deepspeed.checkpoint.utils": "zerotrain.deepspeed.runtime",
    "deepspeed.utils.logging": "zerotrain.deepspeed.utils",
    "deepspeed.utils.zero_to_fp32": "zerotrain.deepspeed.utils",
    "deepspeed.moe.layer": "zerotrain.deepspeed.moe",
}

def target_of(name: str) -> str:
    """The zerotrain module answering DeepSpeed module `name`."""
    return RENAMED.get(name, "zerotrain.deepspeed" + name[len("deepspeed"):])

#: module attributes the import system reads from the stand-in itself
_OWN = frozenset({"__path__", "__file__", "__loader__", "__spec__", "__package__",
                  "__cached__", "__builtins__", "__getattr__", "__dir__"})

class AliasModule(types.ModuleType):
    """`deepspeed.X`: reads fall through to zerotrain's module, then to a submodule."""

    def __getattr__(self, attr: str) -> Any:
        if attr in _OWN:
            raise AttributeError(attr)
        target = importlib.import_module(self.__zerotrain__)
        if hasattr(target, attr):
            return getattr(target, attr)
        try:
            return importlib.import_module(f"{self.__name__}.{attr}")
        except ImportError:
            raise AttributeError(f"module '{self.__name__}' (zerotrain.deepspeed) has no "
                                 f"attribute '{attr}': DeepSpeed API zerotrain does not "
                                 "implement (docs/hf.md lists what it does)") from None

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(importlib.import_module(
            self.__zerotrain__))))

class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        importlib.import_module(target_of(spec.name))  # ImportError here: not implemented
        module = AliasModule(spec.name)
        module.__zerotrain__ = target_of(spec.name)  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: every read goes to zerotrain's module."""

class _Dist(importlib.metadata.Distribution):
    """The distribution `deepspeed` as transformers and Accelerate read it."""

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {DEEPSPEED_VERSION}\n"
                    "Summary: DeepSpeed's API, answered by zerotrain.deepspeed\n")
        return None

    def locate_file(self, path: Any) -> Path:
        return Path(importlib.import_module("zerotrain").__file__).parent / str(path)

class DeepSpeedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        try:
            if importlib.util.find_spec(target_of(fullname)) is None:
                return None
        except ModuleNotFoundError:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)

    def find_distributions(self, context: Any = None) -> list[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() == "deepspeed":
            return [_Dist()]
        return []

FINDER = DeepSpeedFinder()

def installed() -> bool:
    return FINDER in sys.meta_path

def add() -> None:
    """Put the finder first (idempotent)."""
    if not installed():
        sys.meta_path.insert(0, FINDER)

def remove() -> None:
    """Take the finder away and forget the stand-in modules (tests)."""
    if installed():
        sys.meta_path.remove(FINDER)
    for name in [n for n, m in sys.modules.items() if isinstance(m, AliasModule)]:
        del sys.modules[name]
