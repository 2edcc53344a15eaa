"""`initialize` without an optimizer: DeepSpeed's ZeRO inference engine, as the HF Trainer
builds it for `evaluate()` / `predict()` before any `train()` (transformers drops the
config's `optimizer` block and passes no optimizer).

zerotrain runs it with the module whole on every rank: the weights `from_pretrained` wrote
under `zero.Init` (held by the loading rank) are broadcast one parameter at a time and
every rank keeps them all — the host memory of one whole model per rank, more than
DeepSpeed's sharded inference engine. It keeps no optimizer, registers no hooks and
leaves the module an ordinary one, so the `initialize` that `trainer.train()` calls next
(the Trainer discards the evaluation engine first) lays it out as any model.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from zerotrain.deepspeed.pending import _broadcast_one
from zerotrain.deepspeed.surface import ConfigDict
from zerotrain.deepspeed.zero import _swap, take_pending


class InferenceEngine(nn.Module):
    """The engine `initialize` returns with no optimizer: forward only (see the module
    docstring); `backward` / `step` say why not."""

    def __init__(self, model: nn.Module, ds: dict[str, Any], device: torch.device):
        super().__init__()
        pending = take_pending(model)
        for name, p in model.named_parameters():  # the same order on every rank
            if name in pending:
                value, src = pending.pop(name)
                _swap(p, _broadcast_one(value, src, p).to(device=device, dtype=p.dtype))
            elif p.device.type == "meta":
                raise ValueError(
                    f"initialize without an optimizer: parameter '{name}' has "
                    "no value (built under zero.Init and never written)"
                )
        self.module = model.to(device)
        self.ds_config = ds
        self.config = ConfigDict(ds, None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def zero_optimization_stage(self) -> int:
        return int((self.ds_config.get("zero_optimization") or {}).get("stage", 0))

    def backward(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "this engine was built without an optimizer (DeepSpeed's ZeRO "
            "inference: no optimizer= and no `optimizer` block): it runs "
            "forward only; initialize with an optimizer to train"
        )

    step = backward

    def save_checkpoint(
        self,
        save_dir: Any,
        tag: Any = None,
        client_state: Any = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """No training state to save; the Trainer's `save_model` reads the signature and
        writes the weights through `_zero3_consolidated_16bit_state_dict`."""
        raise RuntimeError(
            "this engine was built without an optimizer (ZeRO inference): "
            "there is no training checkpoint to save; save the weights "
            "(trainer.save_model with stage3_gather_16bit_weights_on_model_save)"
        )

    def destroy(self) -> None:
        """Accelerate's `free_memory` (the Trainer's `train()` after `evaluate()`): the
        module stays as it is, an ordinary one, for the next initialize."""

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> OrderedDict[str, torch.Tensor]:
        """The whole module's state dict on rank 0 (every rank holds it whole)."""
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return OrderedDict()
        return OrderedDict(
            (n, t.detach().to("cpu", copy=True))
            for n, t in self.module.state_dict(keep_vars=True).items()
            if not (
                exclude_frozen_parameters and isinstance(t, nn.Parameter) and not t.requires_grad
            )
        )

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        z = self.ds_config.get("zero_optimization", {}) or {}
        return bool(z.get("stage3_gather_16bit_weights_on_model_save", False))
