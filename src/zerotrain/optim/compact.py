"""Compact model states: optimizer states in bf16 or block-wise int8, and bf16 master
weights updated with Kahan compensation or stochastic rounding.

The update rules of `functional.py` stay as they are, in fp32: `run` cuts the tensors
into chunks (whole quantisation blocks, `batching.block_elements` elements), reads each
chunk's states and weights into fp32 working tensors, applies the rule, and stores them
back — rounded to bf16, or quantised (`numerics.blockquant`). Only one chunk is ever
in fp32, so the step's transient memory is bounded as before.

State names in `optimizer.state[p]` (what checkpoints save):

- fp32: `exp_avg` … as torch.optim (the classes never come here).
- bf16: the same names, in bf16.
- int8: `<name>~q8` (uint8 codes, the parameter's shape) and `<name>~scale` (fp32, one
  per `BLOCK` elements). Second moments (`exp_avg_sq`) are stored as √v.
- `master_comp` (Kahan): the bf16 compensation — what the bf16 weight lacks of the
  exact (fp32) value — shaped like the parameter.

`convert_state` moves a loaded state between these forms (a checkpoint saved with
another `optimizer.state_dtype`), and says what it did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from zerotrain.numerics import blockquant as Q
from zerotrain.numerics.compact import FP32, Compact
from zerotrain.optim import compact_kernels as K
from zerotrain.optim.batching import block_elements

#: how each state is quantised: signed (momenta) or as √ of a non-negative (2nd moments)
SQRT_STATES = ("exp_avg_sq",)
COMP = "master_comp"
Q8, SCALE = "~q8", "~scale"


# ----------------------------------------------------------------------------- states


def new_state(p: Tensor, names: Sequence[str], spec: Compact) -> dict[str, Tensor]:
    """Zeroed states `names` of parameter `p` in `spec`'s form."""
    out: dict[str, Tensor] = {}
    for name in names:
        if spec.state_dtype == "int8":
            out[name + Q8] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
            out[name + SCALE] = torch.zeros(
                Q.n_blocks(p.numel()), dtype=torch.float32, device=p.device
            )
        else:
            dt = torch.bfloat16 if spec.state_dtype == "bf16" else torch.float32
            out[name] = torch.zeros(p.shape, dtype=dt, device=p.device)
    if spec.master_update == "kahan" and p.dtype == torch.bfloat16:
        out[COMP] = torch.zeros(p.shape, dtype=torch.bfloat16, device=p.device)
    return out


def read(st: dict[str, Tensor], name: str, a: int, b: int) -> Tensor:
    """Elements [a, b) of state `name` as fp32 (a copy; `a` starts a block for int8)."""
    if name + Q8 in st:
        codes = st[name + Q8].view(-1)[a:b]
        scales = st[name + SCALE][a // Q.BLOCK : Q.n_blocks(b)]
        x = Q.dequantize(codes, scales, signed=name not in SQRT_STATES)
        return x.square_() if name in SQRT_STATES else x
    return st[name].view(-1)[a:b].float()


def write(st: dict[str, Tensor], name: str, a: int, b: int, x: Tensor) -> None:
    """Store fp32 `x` as elements [a, b) of state `name`, in the state's own form."""
    if name + Q8 in st:
        codes = st[name + Q8].view(-1)[a:b]
        scales = st[name + SCALE][a // Q.BLOCK : Q.n_blocks(b)]
        sqrt = name in SQRT_STATES
        Q.quantize_(x.clamp(min=0).sqrt() if sqrt else x, codes, scales, signed=not sqrt)
    else:
        st[name].view(-1)[a:b].copy_(x)


def state_names(st: dict[str, Any]) -> list[str]:
    """The logical state names held in `st` (codes and scales as one)."""
    out = []
    for k in st:
        if k.endswith(SCALE) or k == COMP:
            continue
        out.append(k.removesuffix(Q8))
    return out


# ----------------------------------------------------------------------------- the update


Rule = Callable[..., None]


@dataclass
class _Piece:
    p: Tensor
    g: Tensor
    st: dict[str, Any]
    a: int
    b: int
    off: int = 0  # where the piece starts in the batch's scratch

    @property
    def n(self) -> int:
        return self.b - self.a


def _batches(
    params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[dict], whole: bool
) -> list[list[_Piece]]:
    """Pieces of at most one cache block (whole quantisation blocks; `whole`: each
    tensor entire), gathered into batches of about one cache block."""
    budget = block_elements(params[0].device) if params else 0
    step_ = max(Q.BLOCK, budget // Q.BLOCK * Q.BLOCK)
    out: list[list[_Piece]] = []
    size = budget + 1
    for p, g, st in zip(params, grads, states):
        n = p.numel()
        step = max(1, n if whole else step_)
        for a in range(0, max(n, 1), step):
            pc = _Piece(p, g, st, a, min(n, a + step))
            if size + pc.n > budget:
                out.append([])
                size = 0
            pc.off = size
            out[-1].append(pc)
            size += -(-pc.n // Q.BLOCK) * Q.BLOCK  # every piece starts a block
    return out


def _total(batch: list[_Piece]) -> int:
    last = batch[-1]
    return last.off + -(-last.n // Q.BLOCK) * Q.BLOCK


def _flat(t: Tensor, pc: _Piece) -> Tensor:
    return t.view(-1)[pc.a : pc.b]


def _widen(batch: list[_Piece], srcs: list[Tensor], slot: str) -> list[Tensor]:
    """fp32 views of `srcs` (one per piece): themselves when fp32, else copies in scratch."""
    if all(s.dtype == torch.float32 for s in srcs):
        return srcs
    buf = K.scratch(slot, _total(batch), srcs[0].device)
    views = [buf[pc.off : pc.off + pc.n] for pc in batch]
    torch._foreach_copy_(views, srcs)
    return views


class _StateIO:
    """One state of one batch as fp32 working views, and how it is stored back."""

    def __init__(self, batch: list[_Piece], name: str, slot: int, kern: K.Kernels) -> None:
        self.batch, self.name, self.kern = batch, name, kern
        self.slot = f"s{slot}"
        self.sqrt = name in SQRT_STATES
        if name + Q8 in batch[0].st:
            self.views = self._read_q8()
        else:
            self.src = [_flat(pc.st[name], pc) for pc in batch]
            self.views = _widen(batch, self.src, self.slot)

    def _read_q8(self) -> list[Tensor]:
        batch, dev = self.batch, self.batch[0].p.device
        total = _total(batch)
        self.vals = K.scratch(self.slot, total, dev).view(-1, Q.BLOCK)
        codes = [_flat(pc.st[self.name + Q8], pc) for pc in batch]
        scales = [pc.st[self.name + SCALE][pc.a // Q.BLOCK : Q.n_blocks(pc.b)] for pc in batch]
        if len(batch) == 1 and batch[0].n % Q.BLOCK == 0:  # whole blocks: no copies
            self.codes, self.scales = codes[0].view(-1, Q.BLOCK), scales[0]
            self.back: tuple[list[Tensor], ...] | None = None
        else:  # pack the pieces block-aligned, the padding reading as 0
            self.codes = K.scratch(self.slot + "c", total, dev, torch.uint8).view(-1, Q.BLOCK)
            self.codes.fill_(0 if self.sqrt else 127)  # the code of 0
            self.scales = K.scratch(self.slot + "k", total // Q.BLOCK, dev)
            cv = [self.codes.view(-1)[pc.off : pc.off + pc.n] for pc in batch]
            sv = [
                self.scales[pc.off // Q.BLOCK : pc.off // Q.BLOCK + len(s)]
                for pc, s in zip(batch, scales)
            ]
            torch._foreach_copy_(cv + sv, codes + scales)
            self.back = (codes + scales, cv + sv)
        self.kern.dequant(self.codes, self.scales, self.vals, not self.sqrt, self.sqrt)
        flat = self.vals.view(-1)
        return [flat[pc.off : pc.off + pc.n] for pc in self.batch]

    def store(self) -> None:
        """The working views back into the state's own form."""
        if self.name + Q8 in self.batch[0].st:
            self.kern.quant(self.vals, self.codes, self.scales, not self.sqrt, self.sqrt)
            if self.back is not None:
                torch._foreach_copy_(*self.back)
        elif self.views is not self.src:
            torch._foreach_copy_(self.src, self.views)


def _weights(batch: list[_Piece]) -> list[Tensor]:
    """fp32 working weights: the parameters themselves when fp32, else bf16 + Kahan
    compensation widened into scratch."""
    flats = [_flat(pc.p, pc) for pc in batch]
    views = _widen(batch, flats, "w")
    if views is not flats and COMP in batch[0].st:
        torch._foreach_add_(views, [_flat(pc.st[COMP], pc) for pc in batch])
    return views


def _put_weights(batch: list[_Piece], views: list[Tensor], spec: Compact, kern: K.Kernels) -> None:
    flats = [_flat(pc.p, pc) for pc in batch]
    if all(v.data_ptr() == f.data_ptr() for v, f in zip(views, flats)):  # fp32: in place
        return
    if spec.master_update == "stochastic":
        # the bits: a function of the step and the element's place in the model (the
        # ZeRO views carry their unit coordinates as `zt_origin`), nothing else
        for pc, x, w in zip(batch, views, flats):
            seed = int(pc.st["step"]) if "step" in pc.st else 0
            kern.stochastic(x, w, getattr(pc.p, "zt_origin", 0) + pc.a, seed)
    elif COMP in batch[0].st:  # what bf16 could not hold, kept for the next step
        for pc, x, w in zip(batch, views, flats):
            kern.kahan(x, w, _flat(pc.st[COMP], pc))
    else:
        torch._foreach_copy_(flats, views)


def run(
    spec: Compact,
    rule: Rule,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    states: Sequence[dict],
    names: Sequence[str],
    *,
    whole: bool = False,
    compiled: bool = False,
) -> None:
    """Apply `rule(P, G, *S)` (lists of fp32 tensors, S one list per state in `names`)
    to every parameter, chunk by chunk, with states and weights read and stored in
    `spec`'s forms. `whole`: one chunk per parameter, in its own shape (Muon's
    matrices). Stochastic rounding seeds from each state's `step`. `compiled`: the
    (de)quantisation and rounding through torch.compile (the same numbers, faster)."""
    kern = K.Kernels(compiled)
    for batch in _batches(params, grads, states, whole):
        shape = (lambda pc, t: t.view(pc.p.shape)) if whole else (lambda pc, t: t)
        P = _weights(batch)
        G = _widen(batch, [pc.g.reshape(-1)[pc.a : pc.b] for pc in batch], "g")
        ios = [_StateIO(batch, n, j, kern) for j, n in enumerate(names)]
        rule(
            [shape(pc, t) for pc, t in zip(batch, P)],
            [shape(pc, t) for pc, t in zip(batch, G)],
            *[[shape(pc, t) for pc, t in zip(batch, io.views)] for io in ios],
        )
        for io in ios:
            io.store()
        _put_weights(batch, P, spec, kern)


# ----------------------------------------------------------------------------- conversion


def convert_state(st: dict[str, Any], p: Tensor, spec: Compact) -> str | None:
    """Bring a loaded state dict into `spec`'s form in place; "a → b" when it changed
    form (None when it was already right). fp32 ↔ bf16 ↔ int8 in any direction: to int8
    and to bf16 rounds; from them is exact."""
    names = [
        n
        for n in state_names(st)
        if isinstance(st.get(n, st.get(n + Q8)), Tensor)
        and n != "step"
        and st.get(n, st.get(n + Q8)).numel() == p.numel()
    ]
    before = {_form(st, n) for n in names}
    if not names or before == {spec.state_dtype}:
        return _comp(st, p, spec)
    for n in names:
        if _form(st, n) == spec.state_dtype:
            continue
        x = read(st, n, 0, p.numel())
        for k in (n, n + Q8, n + SCALE):
            st.pop(k, None)
        st.update(new_state(p, [n], Compact(spec.state_dtype)))
        write(st, n, 0, p.numel(), x)
    _comp(st, p, spec)
    return f"{'/'.join(sorted(before))} → {spec.state_dtype}"


def _form(st: dict, name: str) -> str:
    if name + Q8 in st:
        return "int8"
    return "bf16" if st[name].dtype == torch.bfloat16 else "fp32"


def _comp(st: dict, p: Tensor, spec: Compact) -> None:
    want = spec.master_update == "kahan" and p.dtype == torch.bfloat16
    if want and COMP not in st:
        st[COMP] = torch.zeros(p.shape, dtype=torch.bfloat16, device=p.device)
    elif not want:
        st.pop(COMP, None)
    return None


# ----------------------------------------------------------------------------- the mixin


def _step0() -> Tensor:
    return torch.tensor(0.0, dtype=torch.float32)


class CompactStates:
    """Mixed into the optimizer classes (`optimizers._Base`): compact states made,
    run and converted on load."""

    #: how states are stored and bf16 weights updated; set by build_optimizer from
    #: optimizer.state_dtype and precision.master_update
    compact: Compact = FP32
    #: (de)quantisation and rounding through torch.compile (`optimizer.compile`; the
    #: same numbers as eager, see `compact_kernels`)
    compact_compiled: bool = False
    #: what `load_state_dict` converted, for the caller to say
    conversions: tuple[str, ...] = ()
    state: Any
    param_groups: list[dict[str, Any]]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then each state brought into this optimizer's `compact` form
        (a checkpoint saved with another optimizer.state_dtype)."""
        saved = state_dict.get("state", {})
        super().load_state_dict(state_dict)  # type: ignore[misc]
        # torch casts every floating state to its parameter's dtype: undo that where the
        # saved dtype is the state's form (scales stay fp32; a bf16 or fp32 moment is
        # converted below, saying so)
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, st in saved.items():
            p = params[int(idx)] if isinstance(idx, int) or str(idx).isdigit() else None
            if p is None or p not in self.state:
                continue
            for k, v in st.items():
                keep = k.endswith(SCALE) or k == COMP or self.compact.active
                if keep and isinstance(v, Tensor) and v.is_floating_point() and k != "step":
                    self.state[p][k] = v.to(p.device)
        done: dict[str, int] = {}
        for group in self.param_groups:
            for p in group["params"]:
                what = convert_state(self.state[p], p, self.compact) if self.state.get(p) else None
                if what:
                    done[what] = done.get(what, 0) + 1
        self.conversions = tuple(f"optimizer states {k} ({n} tensors)" for k, n in done.items())

    def _compact_state(
        self, p: Tensor, names: tuple[str, ...], step: bool = False
    ) -> dict[str, Any]:
        """`p`'s state with `names` in the compact form (and a step count if `step`)."""
        st = self.state[p]
        if not st:
            st.update({"step": _step0()} if step else {})
            st.update(new_state(p, names, self.compact))
        return st

    def _compact_run(
        self,
        rule: Rule,
        params: list[Tensor],
        names: tuple[str, ...],
        whole: bool = False,
        counted: bool = False,
    ) -> None:
        """`rule` over compact states; stochastic rounding draws its bits from each
        tensor's step count, kept here where the rule keeps none (`counted`: the
        optimizer counts it already)."""
        states = [self.state[p] for p in params]
        if self.compact.master_update == "stochastic":
            for st in states:
                if "step" not in st:
                    st["step"] = _step0()
                if not counted:
                    st["step"] += 1
        run(
            self.compact,
            rule,
            params,
            [p.grad for p in params],
            states,
            names,
            whole=whole,
            compiled=self.compact_compiled,
        )
