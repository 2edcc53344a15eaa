"""The parts of DeepSpeed's engine that Hugging Face's Trainer, Accelerate and TRL use
beyond a DeepSpeed script's own calls (mixed into `DeepSpeedEngine`):

- the engine is a `torch.nn.Module` whose one submodule is `module` (so `parameters()`,
  `named_parameters()`, `modules()` name `module.<name>` as DeepSpeed's do), and calling
  it runs the module's forward;
- `engine.config` is the DeepSpeed config dict (`engine.config["zero_optimization"]`),
  which also answers zerotrain's Config attributes the engine itself reads;
- `set_gradient_accumulation_boundary(b)`: Accelerate decides the boundary and calls
  `step()` only there;
- `backward(loss, scale_wrt_gas=False)`: the Trainer scales the loss itself;
- the ZeRO-3 consolidated state dict `save_model` writes
  (`_zero3_consolidated_16bit_state_dict`, `zero_gather_16bit_weights_on_model_save`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch


class ConfigDict(dict):
    """DeepSpeed's config dict; attribute reads answer zerotrain's mapped Config."""

    def __init__(self, ds: dict[str, Any], config: Any):
        super().__init__(ds)
        self._config = config

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._config, name)

    def model_copy(self, *args: Any, **kwargs: Any) -> Any:
        return self._config.model_copy(*args, **kwargs)


class HFSurface:
    """Mixed into DeepSpeedEngine (before `Engine`); see the module docstring."""

    _boundary: bool | None = None

    @property
    def config(self) -> ConfigDict:
        return self.__dict__["_ds_view"]

    @config.setter
    def config(self, value: Any) -> None:
        ds = self.__dict__.get("ds_config", {})
        self.__dict__["_ds_view"] = value if isinstance(value, ConfigDict) else ConfigDict(
            ds, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward (DeepSpeed's `engine.forward`)."""
        return self(*args, **kwargs)

    def mark_status(self) -> None:
        """Give each parameter DeepSpeed's `ds_status` (TRL reads it before touching the
        LM head directly): AVAILABLE where the parameter is whole whenever the model's
        forward or backward runs (below ZeRO-3; at ZeRO-3 the root unit, which stays
        gathered through the whole forward and backward, and the small persistent
        units), NOT_AVAILABLE for the parameters of ZeRO-3's block units (a reader
        gathers them with `GatheredParameters`, as with DeepSpeed)."""
        from zerotrain.deepspeed.zero import ZeroParamStatus

        strategy = self.strategy  # type: ignore[attr-defined]
        root = getattr(strategy, "_root", None)
        for u in strategy.units:
            whole = strategy.stage < 3 or u is root or getattr(u, "persistent", False)
            for slot in u.slots:
                slot.param.ds_status = (ZeroParamStatus.AVAILABLE if whole
                                        else ZeroParamStatus.NOT_AVAILABLE)

    # ------------------------------------------------------------------ accumulation
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """From now on the boundary is what the caller says (Accelerate: its
        `sync_gradients`), not the micro-step count, as in DeepSpeed."""
        self._boundary = bool(is_boundary)

    def is_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        return super().is_boundary()  # type: ignore[misc]

    # ------------------------------------------------------------------ saving
    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's `stage3_gather_16bit_weights_on_model_save` (DeepSpeed's default:
        False, and then Accelerate refuses to gather a ZeRO-3 model for `save_model`)."""
        z = self.config.get("zero_optimization", {}) or {}
        return bool(z.get("stage3_gather_16bit_weights_on_model_save",
                          z.get("stage3_gather_fp16_weights_on_model_save", False)))

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> OrderedDict[str, torch.Tensor]:
        """Collective: the whole model's state dict (parameters in the module's dtype,
        buffers), on rank 0 only (other ranks get an empty dict), as DeepSpeed's. Tied
        parameters appear under each name, one tensor."""
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        module = self.module  # type: ignore[attr-defined]
        with self.full_parameters():  # type: ignore[attr-defined]
            if self.rank == 0:  # type: ignore[attr-defined]
                seen: dict[int, torch.Tensor] = {}  # tied weights: one tensor, each name
                for name, t in module.state_dict(keep_vars=True).items():  # module order
                    if (exclude_frozen_parameters and isinstance(t, torch.nn.Parameter)
                            and not t.requires_grad):
                        continue
                    if id(t) not in seen:
                        seen[id(t)] = t.detach().to("cpu", copy=True)
                    out[name] = seen[id(t)]
        return out

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                       ) -> OrderedDict[str, torch.Tensor]:
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
