"""How an update rule's work is cut into calls (the speed comes from here, not from
the arithmetic, which lives once in `functional.py`).

- On CPU the lists are re-cut into *blocks* of about `BLOCK_ELEMENTS` elements: big
  tensors are split into contiguous views, small ones are batched together. A rule
  is several passes over its tensors (AdamW: 8); run block by block, passes 2..8 find
  the block in L2 cache, so DRAM sees roughly one read of p, g, m, v and one write of
  p, m, v per step instead of one per pass. Batching also means one Python call per
  block rather than one per small tensor.
- On accelerators there is no cache to fit, but the rule's temporaries (AdamW's
  denominator, L2's g + λθ, Lion's interpolation) are as large as the tensors a call
  gets: handed a whole 1B-parameter shard they would cost GBs of device memory. So the
  lists are cut the same way into chunks of `ACCEL_BLOCK_ELEMENTS` (2^24 elements,
  64 MiB of fp32: big enough that a launch is never the cost, small enough to bound
  the temporaries).
- `compiled=True` (Adam/AdamW) hands each large tensor to `torch.compile` of the same
  `_adam_math`, which fuses the passes into a single loop: one read and one write per
  element, like torch's `fused=True`. Lr- and step-dependent scalars enter as 0-d
  tensors multiplying tensors (never as `value=`/`alpha=` arguments, which the compiler
  would bake in and recompile for every new learning rate).
Measured (bench/optim.py, 2-core Xeon, 1 thread): blocked eager AdamW takes ~2.5x the
time of torch's fused kernel (DRAM traffic is gone, but 8 passes of arithmetic remain);
compiled matches fused.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

#: Elements per cache block on CPU: 1 MiB per fp32 tensor; AdamW touches 5 such
#: tensors per block, which stays inside a 2-4 MiB L2 when two threads share the work.
BLOCK_ELEMENTS = 1 << 18
#: Elements per chunk on accelerators (see the module docstring).
ACCEL_BLOCK_ELEMENTS = 1 << 24
#: Tensors at least this large go through the compiled kernel when `compiled=True`;
#: smaller ones are cheaper in eager batches than as one compiled call each.
COMPILE_MIN_ELEMENTS = 1 << 16


Tensors = Tensor | Sequence[Tensor]


def _as_list(x: Tensors) -> list[Tensor]:
    return [x] if isinstance(x, Tensor) else list(x)


def lists(*xs: Tensors) -> tuple[list[Tensor], ...]:
    """Tensors or lists of them as lists, checked to pair up (same length, same shapes)."""
    out = tuple(_as_list(x) for x in xs)
    n = len(out[0])
    for lst in out[1:]:
        if len(lst) != n:
            raise ValueError(f"tensor lists differ in length ({n} vs {len(lst)})")
        for i, (p, t) in enumerate(zip(out[0], lst)):
            if t.shape != p.shape:
                raise ValueError(f"tensor {i}: shape {tuple(t.shape)} does not match the "
                                 f"parameter's {tuple(p.shape)}; was optimizer state loaded "
                                 "for a different parameter order?")
    return out


def block_elements(device: torch.device) -> int:
    """Elements per batch of one rule call: cache blocks on the CPU, bounded chunks on
    accelerators (see the module docstring)."""
    return BLOCK_ELEMENTS if device.type == "cpu" else ACCEL_BLOCK_ELEMENTS


def _blocks(lists: tuple[list[Tensor], ...]) -> Iterator[tuple[list[Tensor], ...]]:
    """Re-cut parallel tensor lists into batches of at most `block_elements` (a tensor
    too large to split — not contiguous — goes alone)."""
    if not lists[0]:
        return
    block = block_elements(lists[0][0].device)
    batch: tuple[list[Tensor], ...] = tuple([] for _ in lists)
    size = 0
    for i in range(len(lists[0])):
        ts = [lst[i] for lst in lists]
        n = ts[0].numel()
        if n > block and all(t.is_contiguous() for t in ts):
            if size:
                yield batch
                batch, size = tuple([] for _ in lists), 0
            yield from zip(*([[piece] for piece in t.view(-1).split(block)] for t in ts))
            continue
        if size and size + n > block:
            yield batch
            batch, size = tuple([] for _ in lists), 0
        for lst, t in zip(batch, ts):
            lst.append(t)
        size += n
    if size:
        yield batch


_COMPILED: dict[Callable, Callable] = {}
_COMPILE_BROKEN = False


def compile_rule(math_fn: Callable) -> Callable:
    """`math_fn` through torch.compile (once per process; shapes stay dynamic)."""
    fn = _COMPILED.get(math_fn)
    if fn is None:
        fn = _COMPILED[math_fn] = torch.compile(math_fn, dynamic=True, fullgraph=True)
    return fn


def run(
    math_fn: Callable,
    lists: tuple[list[Tensor], ...],
    scalars: tuple[float, ...],
    consts: dict,
    compiled: bool = False,
) -> None:
    """Apply `math_fn` block by block; big tensors optionally through torch.compile."""
    global _COMPILE_BROKEN
    if compiled and not _COMPILE_BROKEN:
        big = [
            i for i, t in enumerate(lists[0])
            if t.numel() >= COMPILE_MIN_ELEMENTS and all(lst[i].is_contiguous() for lst in lists)
        ]
        if big:
            fn = compile_rule(math_fn)
            done: set[int] = set()
            boxed: dict[torch.device, list[Tensor]] = {}  # the scalars, once per device
            try:
                for i in big:
                    dev = lists[0][i].device
                    if dev not in boxed:
                        boxed[dev] = _boxed(dev, scalars)
                    fn(*([lst[i]] for lst in lists), *boxed[dev], **consts)
                    done.add(i)
            except Exception as e:  # no C++ compiler / triton: stay correct, just slower
                _COMPILE_BROKEN = True
                warnings.warn(f"torch.compile of the optimizer step failed ({e!r:.200}); "
                              "falling back to eager", RuntimeWarning, stacklevel=3)
            keep = [i for i in range(len(lists[0])) if i not in done]
            lists = tuple([lst[i] for i in keep] for lst in lists)
    for batch in _blocks(lists):
        math_fn(*batch, *scalars, **consts)


_BOXES: dict[torch.device, list[Tensor]] = {}


def _boxed(device: torch.device, scalars: tuple[float, ...]) -> list[Tensor]:
    """The step's scalars as 0-d float64 tensors on `device`, refilled in place: `fill_`
    is queued on the device's stream, where `torch.tensor(s, device=cuda)` would be a
    blocking copy (a stream drain per scalar per step). Reuse is safe because every use
    is queued on the same stream, in order."""
    boxes = _BOXES.setdefault(device, [])
    while len(boxes) < len(scalars):
        boxes.append(torch.zeros((), dtype=torch.float64, device=device))
    for box, s in zip(boxes, scalars):
        box.fill_(s)
    return boxes[:len(scalars)]


def compile_broken() -> bool:
    """Whether torch.compile of an update rule has failed in this process (then every
    rule runs eager)."""
    return _COMPILE_BROKEN
