"""A stand-in accelerator for CPU-only tests: tensors that say they live on `meta`,
hold real CPU data, and refuse to mix with CPU tensors — as CUDA tensors would.

With NCCL, a process group has no CPU backend ("No backend type associated with device
type cpu"), so every tensor handed to a collective must live on the GPU. Without a GPU
we reproduce that contract:

- `SimDevice()` is a dispatch mode: inside it, anything sent to or created on `meta`
  becomes a `SimTensor` (the values are kept on the CPU underneath). An op that meets a
  SimTensor and a CPU tensor raises, as CUDA does, with exactly CUDA's exceptions
  (`_allowed`): copies between devices (`copy_`, `.to`), a 0-d CPU tensor read as a
  scalar by an elementwise op (TensorIterator's CPU-scalar rule; `fill_`, `masked_fill`,
  the `_foreach_` ops), and CPU index tensors in advanced indexing. Everything else —
  `stack`, `cat`, `index_select`, matmul, a CPU tensor written by a device op, a 0-d
  CPU tensor anywhere but a read elementwise operand — is refused, 0-d or not.
- `nccl_like_all_reduce(real)` replaces `dist.all_reduce`: a CPU tensor is refused with
  NCCL's error; a SimTensor is reduced for real (its CPU data over the gloo group). Each
  call's device and calling function are recorded.
"""

from __future__ import annotations

import inspect

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

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
        if func is torch.ops.aten._to_copy.default and _target(kwargs) == "cpu":
            a = tree_map(_unwrap, args)
            return func(*a, **{n: v for n, v in kwargs.items() if n != "device"})
        refused = _refused(func, args, kwargs)
        if refused:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at "
                               f"least two devices, meta (simulated) and cpu ({refused} of "
                               f"{func})")
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if func is torch.ops.aten._local_scalar_dense.default:
            return out
        rets = func._schema.returns
        if len(rets) == 1 and rets[0].alias_info is not None and rets[0].alias_info.is_write:
            return args[0]  # in place (copy_, add_ …): the tensor written, as torch returns
        return tree_map(lambda x: SimTensor(x) if isinstance(x, torch.Tensor) else x, out)


def _unwrap(x):
    return x.inner if isinstance(x, SimTensor) else x


_aten = torch.ops.aten
#: copies between devices: what `.to()` / `copy_` are for, on CUDA too
_COPIES = {_aten.copy_.default, _aten._copy_from.default, _aten._to_copy.default,
           _aten._foreach_copy_.default}
#: ops that read a 0-d CPU tensor as a scalar on CUDA (besides the pointwise-tagged ones)
_SCALAR_READERS = {_aten.fill_.Tensor, _aten.masked_fill_.Tensor, _aten.masked_fill.Tensor}
#: advanced indexing accepts CPU index tensors for a CUDA tensor (and a 0-d CPU value)
_INDEXING = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default,
             _aten._index_put_impl_.default}


def _reads_scalars(func) -> bool:
    return (torch.Tag.pointwise in func.tags or func in _SCALAR_READERS
            or func.__name__.startswith("_foreach_"))


def _refused(func, args: tuple, kwargs: dict) -> str | None:
    """Why CUDA would refuse this op (which argument is a CPU tensor), or None."""
    if func in _COPIES:
        return None
    has_sim, cpu = False, []
    schema = func._schema.arguments
    for i, arg in enumerate(schema):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        written = arg.alias_info is not None and arg.alias_info.is_write
        for t in tree_flatten(value)[0]:
            if isinstance(t, SimTensor):
                has_sim = True
            elif isinstance(t, torch.Tensor) and t.device.type == "cpu":
                if func in _INDEXING and arg.name == "indices":
                    continue
                if t.dim() == 0 and not written and (
                        _reads_scalars(func) or (func in _INDEXING and arg.name == "values")):
                    continue
                cpu.append(f"argument '{arg.name}'" + (" (0-d)" if t.dim() == 0 else ""))
    return ", ".join(cpu) if has_sim and cpu else None


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
