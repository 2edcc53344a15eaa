"""Activation checkpointing of a plan's units, for any model: `model.activation_checkpointing`.

`apply_checkpointing(blocks, mode)` replaces each block's `forward` (an instance attribute:
the user's class and parameter names stay as they are) by one that runs the original
under `torch.utils.checkpoint` (non-reentrant) while training: nothing inside the block
is saved for backward, only its inputs, and the backward recomputes the block. The
block's `__call__` — and so ZeRO-3's unshard hooks — runs once in forward; the recompute
calls the original `forward` directly, inside backward, after the output-gradient hook
gathered the unit again (zero/zero3.py), so the recompute reads gathered parameters.

`offload` also moves each block's hidden-state input (its first positional tensor, or
`hidden_states=`) to pinned host memory on a side stream as soon as forward has it, and
brings it back for the recompute; while block i recomputes, block i-1's input is already
being copied back (`HostStash.prev`). The other inputs (rotary tables, masks) are shared
by every block and stay where they are. On a CPU the host is the device: `offload`
equals `true` (the engine says so once).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from zerotrain.memory.host import PINNED

#: `model.activation_checkpointing` values
Mode = bool | str

_WRAPPED = "_zerotrain_checkpoint"  # marks a forward this module installed


class CudaCopies:
    """The CUDA calls `HostStash` makes, in one place (a test stands in for them)."""

    def side(self, device: torch.device) -> Any:
        if device not in _STREAMS:
            _STREAMS[device] = torch.cuda.Stream(device)
        return _STREAMS[device]

    def current(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def event(self) -> Any:
        return torch.cuda.Event()

    def host_like(self, x: Tensor) -> Tensor:
        return PINNED.take(x.numel(), x.dtype).view(x.shape)

    def recycle(self, host: Tensor) -> None:
        """`host` is free for the next stash: every copy that reads or writes it is on
        the one side stream, so the next copy into it is ordered after this one's."""
        PINNED.give(host)

    def device_like(self, t: Tensor, device: torch.device) -> Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=device)

    def keep(self, t: Tensor, stream: Any) -> None:
        """`t`'s memory is not reused before the work queued on `stream` is done."""
        t.record_stream(stream)


class _NoStream:
    def wait_stream(self, other: Any) -> None: ...
    def wait_event(self, event: Any) -> None: ...
    def record(self, stream: Any = None) -> None: ...


class HostCopies(CudaCopies):
    """Off CUDA: plain copies, no streams (a CPU test of the stash's bookkeeping)."""

    def side(self, device: torch.device) -> Any:
        return _NoStream()

    def current(self, device: torch.device) -> Any:
        return _NoStream()

    def on(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def event(self) -> Any:
        return _NoStream()

    def host_like(self, x: Tensor) -> Tensor:
        return torch.empty(x.shape, dtype=x.dtype)

    def device_like(self, t: Tensor, device: torch.device) -> Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=device)

    def keep(self, t: Tensor, stream: Any) -> None: ...

    def recycle(self, host: Tensor) -> None: ...



class HostStash:
    """One block input kept off the device between forward and its recompute.

    The copy to (pinned) host memory is queued on a side stream after the work that
    made the input, so the block's forward does not wait for it; the device tensor's
    memory is released once the copy is done (`keep`). `get()` returns the original
    tensor the first time (forward), and a device copy the second (recompute), after the
    current stream waited for that copy; it then starts bringing back the previous
    block's input, which arrives while this block recomputes and runs backward.
    """

    _last: HostStash | None = None  # the latest stash of the running forward

    def __init__(self, x: Tensor, rt: CudaCopies):
        self.rt, self.first, self.device = rt, x, x.device
        # the recompute must see an input like the original: autograd saves what an op
        # needs for the inputs that require grad, and checkpoint checks the counts match
        self.requires_grad = x.requires_grad
        self.prev, HostStash._last = HostStash._last, self
        self.dev: Tensor | None = None
        self.done = False
        self.stream = rt.side(x.device)
        self.stream.wait_stream(rt.current(x.device))  # x is written before it is read
        self.host: Tensor | None = rt.host_like(x)
        with rt.on(self.stream):
            self.host.copy_(x, non_blocking=True)
        rt.keep(x, self.stream)
        self.ready = rt.event()
        self.ready.record(self.stream)

    def fetch(self) -> None:
        """Start the copy back to the device (idempotent; a no-op once consumed)."""
        if self.done or self.dev is not None:
            return
        assert self.host is not None
        self.dev = self.rt.device_like(self.host, self.device)
        # the block came from the compute stream's pool, freed in host order: its last
        # reader may still be queued there, so the side stream's write waits for it
        self.stream.wait_stream(self.rt.current(self.device))
        with self.rt.on(self.stream):
            self.stream.wait_event(self.ready)  # the copy to the host is complete
            self.dev.copy_(self.host, non_blocking=True)
            self.ready = self.rt.event()
            self.ready.record(self.stream)
        self.rt.keep(self.dev, self.stream)

    def get(self) -> Tensor:
        if self.first is not None:  # the forward itself
            x, self.first = self.first, None
            return x
        self.fetch()
        self.rt.current(self.device).wait_event(self.ready)
        assert self.host is not None
        self.rt.recycle(self.host)
        x, self.dev, self.host, self.done = self.dev, None, None, True
        prev, self.prev = self.prev, None
        if prev is not None:  # overlap: the previous block's input comes back meanwhile
            prev.fetch()
        assert x is not None
        return x.requires_grad_(self.requires_grad)


_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")

_STREAMS: dict[torch.device, Any] = {}
#: the copies HostStash makes on CUDA, and (tests) elsewhere
CUDA_COPIES: CudaCopies = CudaCopies()
HOST_COPIES: CudaCopies = HostCopies()


def _hidden_arg(args: tuple, kwargs: dict) -> tuple[str | int, Tensor] | None:
    """Where a block's hidden-state input is: its first positional tensor, or the
    `hidden_states` keyword (Hugging Face decoder layers)."""
    if args and isinstance(args[0], Tensor):
        return 0, args[0]
    if isinstance(kwargs.get("hidden_states"), Tensor):
        return "hidden_states", kwargs["hidden_states"]
    return None


def _checkpoint(fn: Callable[..., Any], device: torch.device | None, args: tuple,
                kwargs: dict) -> Any:
    """`torch.utils.checkpoint` with the block's device named: torch saves (and replays in
    the recompute) the RNG state only of the devices its positional tensors are on, and
    the hidden state may be a keyword or, offloaded, absent. Without it dropout would
    draw other masks in the recompute than in forward on CUDA (the CPU RNG is always
    saved). A 0-element tensor on that device, first, carries the device."""
    if device is None:
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    anchor = torch.empty(0, device=device)
    return checkpoint(_without_anchor, anchor, fn, *args, use_reentrant=False, **kwargs)


def _without_anchor(anchor: Tensor, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def checkpointed_forward(block: nn.Module, original: Callable[..., Any], offload: bool,
                         force_stash: bool = False) -> Callable[..., Any]:
    """`block`'s forward under checkpointing (training with gradients only; evaluation
    and generation run the original). `force_stash`: use `HostStash` off CUDA too
    (tests of the bookkeeping)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not (block.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        # a KV cache (Hugging Face layers get one when use_cache is on) would keep every
        # layer's keys and values alive and grow again at each recompute: training with
        # checkpointing runs without it, as HF's own gradient checkpointing does
        for k in _CACHE_KWARGS:
            if kwargs.get(k) is not None:
                kwargs = {**kwargs, k: None}
        if kwargs.get("use_cache"):
            kwargs = {**kwargs, "use_cache": False}
        where = _hidden_arg(args, kwargs)
        if not offload or where is None or not (where[1].is_cuda or force_stash):
            return _checkpoint(original, where[1].device if where else None, args, kwargs)
        key, x = where
        # the checkpoint keeps the stash, not the device tensor
        stash = HostStash(x, CUDA_COPIES if x.is_cuda else HOST_COPIES)

        def run(*a: Any, **k: Any) -> Any:
            if key == 0:
                a = (stash.get(), *a[1:])
            else:
                k = {**k, key: stash.get()}
            return original(*a, **k)

        if key == 0:
            args = (None, *args[1:])
        else:
            kwargs = {**kwargs, key: None}
        return _checkpoint(run, x.device, args, kwargs)

    setattr(forward, _WRAPPED, original)
    return forward


def apply_checkpointing(blocks: Iterable[nn.Module], mode: Mode,
                        force_stash: bool = False) -> int:
    """Checkpoint each block (`True`), also offloading its input (`"offload"`), or undo
    (`False`). Idempotent: a block already wrapped is re-wrapped from its original
    forward. Returns how many blocks are checkpointed."""
    n = 0
    for b in blocks:
        current = b.__dict__.get("forward")
        if current is not None and hasattr(current, _WRAPPED):
            del b.forward  # back to the class's forward
        if mode is False or mode is None:
            continue
        b.forward = checkpointed_forward(b, b.forward, mode == "offload", force_stash)
        n += 1
    return n


def checkpoint_mode(block: nn.Module) -> bool:
    """Whether `block`'s forward is one `apply_checkpointing` installed."""
    return hasattr(block.__dict__.get("forward"), _WRAPPED)
