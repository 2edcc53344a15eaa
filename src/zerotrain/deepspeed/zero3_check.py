"""Models that zerotrain's ZeRO-3 cannot run as written: refused in one line naming the
setting, before the first update.

zerotrain's ZeRO-3 gathers a unit's parameters (a block of the model's largest
`nn.ModuleList`; everything else is the root unit, always whole) only while that block's
forward runs, driven by hooks on the block; between, they point at NaN. Two kinds of
model therefore do not fail but train on NaN (every update skipped):

- a parameter shared by two units — tied across blocks, or a block's weight reused by a
  module outside the blocks: refused when the engine is built (`tied_across_units`);
- a forward that reads a block's parameter outside that block's call — `x @
  self.layers[0].proj.weight`, `block.forward(x)` or a block's submodule called from
  outside, a block's bare `nn.Parameter` used by the parent: found by watching the
  engine's first forward (`OutsideReads`, a TorchFunctionMode that looks at each torch
  call's parameter arguments) and refused there, before the first backward.

Units that stay gathered (smaller than `stage3_param_persistence_threshold` elements) are
never concerned: they work as written. Every rank runs the same model code, so every rank
raises at the same point (no rank is left waiting in a collective).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from zerotrain.config.base import ConfigError

#: what a message offers instead
_FIX = (
    "set zero_optimization.stage to 2 (parameters whole on every rank), or raise "
    "zero_optimization.stage3_param_persistence_threshold above {numel} so that this "
    "unit stays gathered"
)
#: Tensor properties that compute from the values (the rest read metadata)
_COMPUTING = {"T", "mT", "H", "mH", "real", "imag"}
#: Tensor methods that read only metadata
_METADATA = {
    "numel",
    "size",
    "dim",
    "ndimension",
    "nelement",
    "element_size",
    "stride",
    "is_floating_point",
    "is_complex",
    "is_contiguous",
    "data_ptr",
    "storage_offset",
    "untyped_storage",
    "requires_grad_",
    "register_hook",
    "__repr__",
    "__format__",
    "__hash__",
    "get_device",
}


def _unit_of_module(strategy: Any, model: nn.Module) -> dict[int, Any]:
    """id(module) -> the unit whose hooks drive it (block units; the root is the rest)."""
    out: dict[int, Any] = {}
    for u in strategy.units:
        if u.module is not None and u.module is not model:
            for m in u.module.modules():
                out[id(m)] = u
    return out


def tied_across_units(strategy: Any, model: nn.Module) -> str | None:
    """One line naming a parameter two ZeRO-3 units use, when its owner is sharded; else
    None."""
    owner = {id(s.param): (u, s.name) for u in strategy.units for s in u.slots}
    unit_of = _unit_of_module(strategy, model)
    root = next((u for u in strategy.units if u.module is model), None)
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        here = unit_of.get(id(mod), root)
        for pname, p in mod.named_parameters(recurse=False):
            got = owner.get(id(p))
            if got is None or got[0] is here or getattr(got[0], "persistent", False):
                continue
            u, name = got
            where = f"{mod_name}.{pname}" if mod_name else pname
            return (
                f"zero_optimization.stage=3: {type(model).__name__}'s parameter "
                f"'{where}' is the same tensor as '{name}' of another ZeRO-3 unit "
                f"('{u.name}'): zerotrain gathers a unit's parameters only while that "
                "unit runs, so the other would read NaN; untie them, or "
                + _FIX.format(numel=u.numel)
            )
    return None


class OutsideReads(TorchFunctionMode):
    """Raise on the first torch call that reads a sharded block parameter (see the module
    docstring); active for one forward."""

    def __init__(self, strategy: Any, model: nn.Module):
        super().__init__()
        self.model = model
        self.where = {
            id(s.param): (u, s.name)
            for u in strategy.units
            if u.module is not model and not getattr(u, "persistent", False)
            for s in u.slots
        }

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.where and _reads_values(func):
            for a in tree_flatten((args, kwargs))[0]:
                if isinstance(a, nn.Parameter) and id(a) in self.where:
                    self._check(a, func)
        return func(*args, **kwargs)

    def _check(self, p: nn.Parameter, func: Any) -> None:
        from zerotrain.zero.unit import UnitState

        u, name = self.where[id(p)]
        if u.state is not UnitState.SHARDED:
            return
        what = getattr(func, "__name__", None) or repr(func)
        if what == "__get__":
            what = f"Tensor.{func.__self__.__name__}"
        raise ConfigError(
            f"zero_optimization.stage=3: {type(self.model).__name__}'s forward reads "
            f"parameter '{name}' outside the forward of its ZeRO-3 unit '{u.name}' (in "
            f"{what}): zerotrain gathers a unit's parameters only while that module is "
            "called, so this model would train on NaN; call the module instead of "
            "reading its weights, or " + _FIX.format(numel=u.numel)
        )


def _reads_values(func: Any) -> bool:
    """Whether a torch call can read its tensors' values (not only their metadata)."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return name == "__get__" and getattr(func.__self__, "__name__", "") in _COMPUTING
    return name not in _METADATA


def watch_first_forward(strategy: Any, model: nn.Module) -> OutsideReads | None:
    """The mode to run the first forward under, or None where nothing is sharded."""
    if getattr(strategy, "stage", 0) < 3:
        return None
    mode = OutsideReads(strategy, model)
    return mode if mode.where else None


def check_model(strategy: Any, model: nn.Module) -> None:
    """At initialize: refuse parameters tied across ZeRO-3 units (one line)."""
    if getattr(strategy, "stage", 0) < 3:
        return
    problem = tied_across_units(strategy, model)
    if problem:
        raise ConfigError(problem)


__all__ = ["OutsideReads", "check_model", "tied_across_units", "watch_first_forward"]
