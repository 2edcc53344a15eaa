"""A stand-in accelerator for CPU-only tests: tensors that say they live on `meta`,
hold real CPU data, and refuse to mix with CPU tensors — as CUDA tensors would.

With NCCL, a process group has no CPU backend ("No backend type associated with device
type cpu"), so every tensor handed to a collective must live on the GPU. Without a GPU
we reproduce that contract:

- `SimDevice()` is a dispatch mode: inside it, anything sent to or created on `meta`
  becomes a `SimTensor` (the values are kept on the CPU underneath); arithmetic mixing a
  SimTensor with a CPU tensor raises, like mixing devices on a GPU.
- `nccl_like_all_reduce(real)` replaces `dist.all_reduce`: a CPU tensor is refused with
  NCCL's error; a SimTensor is reduced for real (its CPU data over the gloo group). Each
  call's device and calling function are recorded.
"""

from __future__ import annotations

import inspect

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

SIM = torch.device("meta")


class SimTensor(torch.Tensor):
    """A tensor labelled `meta` whose data lives in `self.inner` on the CPU."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, dtype=inner.dtype, device=SIM, strides=inner.stride(),
            requires_grad=False)

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    def __repr__(self) -> str:
        return f"SimTensor({self.inner})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kinds: set[str] = set()

        def unwrap(x):
            if isinstance(x, SimTensor):
                kinds.add("sim")
                return x.inner
            if isinstance(x, torch.Tensor) and x.dim() > 0:  # 0-d CPU scalars mix, as on CUDA
                kinds.add(x.device.type)
            return x

        a, k = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        if func is torch.ops.aten._to_copy.default and _target(k) == "cpu":
            return func(*a, **{n: v for n, v in k.items() if n != "device"})
        if len(kinds) > 1:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found "
                               f"{sorted(kinds)} in {func}")
        out = func(*a, **k)
        if func is torch.ops.aten._local_scalar_dense.default:
            return out
        return tree_map(lambda x: SimTensor(x) if isinstance(x, torch.Tensor) else x, out)


def _target(kwargs: dict) -> str | None:
    d = kwargs.get("device")
    return torch.device(d).type if d is not None else None


class SimDevice(TorchDispatchMode):
    """Inside this mode, tensors moved to or made on `meta` are SimTensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _target(kwargs) == "meta":
            k = {n: v for n, v in kwargs.items() if n != "device"}
            src = tree_map(lambda x: x.inner if isinstance(x, SimTensor) else x, args)
            return SimTensor(func(*src, **k))
        return func(*args, **kwargs)


class _Done:
    def wait(self) -> bool:
        return True


def nccl_like_all_reduce(real, calls: list[tuple[str, str]]):
    """A `dist.all_reduce` that behaves like NCCL's for device placement (see above)."""

    def all_reduce(tensor, op=None, group=None, async_op=False):
        caller = next((f.function for f in inspect.stack()[1:]
                       if "zerotrain/comm/" not in f.filename.replace("\\", "/")), "?")
        calls.append((tensor.device.type, caller))
        if not isinstance(tensor, SimTensor):
            raise RuntimeError("No backend type associated with device type cpu")
        kw = {"op": op} if op is not None else {}
        real(tensor.inner, group=group, **kw)
        return _Done() if async_op else None

    return all_reduce
