"""A minimal `get_accelerator()`, for the device lines of DeepSpeed scripts:

    from zerotrain.deepspeed.accelerator import get_accelerator
    device = torch.device(get_accelerator().device_name(engine.local_rank))

CUDA when a GPU is visible, else the CPU (the device zerotrain trains on).
"""

from __future__ import annotations

import torch


class Accelerator:
    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()

    def device_name(self, device_index: int | None = None) -> str:
        if not self.cuda:
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self.cuda else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self.cuda else "cpu"

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.cuda else 1

    def is_available(self) -> bool:
        return True  # the CPU always is; DeepSpeed's CPU accelerator says the same

    def set_device(self, device_index: int) -> None:
        if self.cuda:
            torch.cuda.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        if self.cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self.cuda else "gloo"

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def is_bf16_supported(self) -> bool:
        return not self.cuda or torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return self.cuda

    def empty_cache(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator()
    return _ACCELERATOR
