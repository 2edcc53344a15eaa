"""torch.optim-compatible optimizer classes around the rules in `functional.py`.

The classes only keep state and hyper-parameters; every update is one call into
`functional`. State uses torch's names (`momentum_buffer`, `sum`, `square_avg`,
`exp_avg`, `exp_avg_sq`, `step` as a float32 0-d tensor), so a torch.optim checkpoint
loads into these classes and theirs into torch's, and training continues identically.

They work equally for a model's many parameters and for the few large flat fp32
segments the ZeRO engine hands over: `functional` cuts both into cache-sized blocks.
Muon, which needs whole matrices, is in `muon.py` beside its rule, on the same `_Base`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from zerotrain.optim import compact as C
from zerotrain.optim import functional as F
from zerotrain.optim.torch_rule import torch_adam_

Params = Iterable[Tensor] | Iterable[dict[str, Any]]


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _check_betas(betas: tuple[float, float], name: str = "betas") -> None:
    _check(len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas),
           f"{name} must be two numbers in [0, 1), got {betas}")


class _Base(C.CompactStates, torch.optim.Optimizer):
    """Shared plumbing: step() loop, state init, torch-compatible loading."""

    #: torch.optim group flags we do not implement; a checkpoint asking for them is refused.
    _REFUSED = ("amsgrad", "maximize", "differentiable")
    #: called once, at the first step() (build_optimizer's compile vote across ranks)
    before_first_step: Callable[[], None] | None = None
    #: True when the rule treats every element alone, so a flat run of many parameters
    #: can stand in for them (ZeRO shards, stage 0's per-group views). Muon is not: it
    #: orthogonalises whole matrices and needs their real shapes.
    elementwise = True
    @classmethod
    def state_bytes_per_param(cls, momentum: float = 0.0, **hyper: Any) -> int:
        """fp32 bytes of optimizer state per parameter (K in the memory model)."""
        raise NotImplementedError

    def __setstate__(self, state: dict[str, Any]) -> None:
        # load_state_dict replaces each group dict by the saved one; a torch.optim
        # checkpoint lacks our own keys (e.g. `compiled`), so fill in our defaults.
        super().__setstate__(state)
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter that has a gradient; returns closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.before_first_step is not None:  # decided by all ranks at their first step
            hook, self.before_first_step = self.before_first_step, None
            hook()
        for group in self.param_groups:
            for flag in self._REFUSED:
                if group.get(flag):
                    raise ValueError(f"{type(self).__name__} does not implement torch.optim's "
                                     f"{flag}=True; use torch.optim for that")
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise ValueError(f"{type(self).__name__} does not support sparse gradients")
            if params:
                self._update(group, params)
        return loss

    def _update(self, group: dict[str, Any], params: list[Tensor]) -> None:
        raise NotImplementedError

    def _state(self, p: Tensor, init: Callable[[Tensor], dict[str, Tensor]]) -> dict[str, Any]:
        st = self.state[p]
        if not st:
            st.update(init(p))
        return st

    def _count_step(self, params: list[Tensor]) -> dict[tuple, list[Tensor]]:
        """Increment each param's step and bucket params by (device, step) for one call."""
        buckets: dict[tuple, list[Tensor]] = defaultdict(list)
        for p in params:
            st = self.state[p]
            st["step"] += 1
            buckets[(p.device, int(st["step"].item()))].append(p)
        return buckets


def _zeros(p: Tensor) -> Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def _step0() -> Tensor:
    return torch.tensor(0.0, dtype=torch.float32)


ADAM_STATES = ("exp_avg", "exp_avg_sq")


def _adam_state(p: Tensor) -> dict[str, Tensor]:
    return {"step": _step0(), "exp_avg": _zeros(p), "exp_avg_sq": _zeros(p)}


def _grads(params: list[Tensor]) -> list[Tensor]:
    return [p.grad for p in params]  # type: ignore[misc]


def _get(params: list[Tensor], states: Any, key: str) -> list[Tensor]:
    return [states[p][key] for p in params]


class SGD(_Base):
    """SGD with optional (Nesterov) momentum and dampening; L2 weight decay like torch."""

    def __init__(self, params: Params, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False) -> None:
        _check(lr >= 0, f"lr must be >= 0, got {lr}")
        _check(momentum >= 0, f"momentum must be >= 0, got {momentum}")
        _check(weight_decay >= 0, f"weight_decay must be >= 0, got {weight_decay}")
        _check(not nesterov or (momentum > 0 and dampening == 0),
               "nesterov=True needs momentum > 0 and dampening 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    @classmethod
    def state_bytes_per_param(cls, momentum: float = 0.0, **hyper: Any) -> int:
        """0 for plain SGD, 4 with a momentum buffer."""
        return 4 if momentum > 0 else 0

    def _update(self, group: dict[str, Any], params: list[Tensor]) -> None:
        kw = dict(lr=group["lr"], momentum=group["momentum"], dampening=group["dampening"],
                  nesterov=group["nesterov"], weight_decay=group["weight_decay"])
        if self.compact.active:
            self._compact_update(params, kw)
            return
        if not group["momentum"]:
            F.sgd_(params, _grads(params), None, **kw)
            return
        # torch creates the buffer lazily at the first step, equal to the gradient
        fresh = [p for p in params if self.state[p].get("momentum_buffer") is None]
        for p in fresh:
            self.state[p]["momentum_buffer"] = _zeros(p)
        fresh_ids = {id(p) for p in fresh}
        old = [p for p in params if id(p) not in fresh_ids]
        for ps, init in ((fresh, True), (old, False)):
            if ps:
                F.sgd_(ps, _grads(ps), _get(ps, self.state, "momentum_buffer"), init=init, **kw)

    def _compact_update(self, params: list[Tensor], kw: dict[str, Any]) -> None:
        if not kw["momentum"]:  # no state: only the weights' rounding is compact
            for p in params:
                self._compact_state(p, ())
            self._compact_run(lambda P, G: F.sgd_(P, G, None, **kw), params, ())
            return
        fresh = [p for p in params if not self.state[p]]
        for p in params:
            self._compact_state(p, ("momentum_buffer",))
        ids = {id(p) for p in fresh}
        for ps, init in ((fresh, True), ([p for p in params if id(p) not in ids], False)):
            if ps:
                self._compact_run(lambda P, G, B, i=init: F.sgd_(P, G, B, init=i, **kw), ps,
                                  ("momentum_buffer",))


class Adagrad(_Base):
    """AdaGrad with torch's lr_decay, initial_accumulator_value and eps."""

    def __init__(self, params: Params, lr: float = 1e-2, lr_decay: float = 0.0,
                 weight_decay: float = 0.0, initial_accumulator_value: float = 0.0,
                 eps: float = 1e-10) -> None:
        _check(lr >= 0, f"lr must be >= 0, got {lr}")
        _check(lr_decay >= 0, f"lr_decay must be >= 0, got {lr_decay}")
        _check(weight_decay >= 0, f"weight_decay must be >= 0, got {weight_decay}")
        _check(initial_accumulator_value >= 0,
               f"initial_accumulator_value must be >= 0, got {initial_accumulator_value}")
        _check(eps >= 0, f"eps must be >= 0, got {eps}")
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value,
                                      eps=eps))
        # torch allocates AdaGrad's state up front (not at the first step); so do we,
        # so that state_dict() matches before any step has run
        for group in self.param_groups:
            for p in group["params"]:
                self._init(p, group)

    def _init(self, p: Tensor, group: dict[str, Any]) -> None:
        v = group["initial_accumulator_value"]
        self._state(p, lambda p: {
            "step": _step0(), "sum": torch.full_like(p, v, memory_format=torch.preserve_format)})

    @classmethod
    def state_bytes_per_param(cls, momentum: float = 0.0, **hyper: Any) -> int:
        """4: the running sum of squared gradients."""
        return 4

    def _update(self, group: dict[str, Any], params: list[Tensor]) -> None:
        for p in params:  # groups added after construction
            self._init(p, group)
        for (_, step), ps in self._count_step(params).items():
            F.adagrad_(ps, _grads(ps), _get(ps, self.state, "sum"), step=step, lr=group["lr"],
                       lr_decay=group["lr_decay"], weight_decay=group["weight_decay"],
                       eps=group["eps"])


class RMSprop(_Base):
    """RMSProp like torch: ε outside the root, optional momentum and centering."""

    def __init__(self, params: Params, lr: float = 1e-2, alpha: float = 0.99,
                 eps: float = 1e-8, weight_decay: float = 0.0, momentum: float = 0.0,
                 centered: bool = False) -> None:
        _check(lr >= 0, f"lr must be >= 0, got {lr}")
        _check(0 <= alpha <= 1, f"alpha must be in [0, 1], got {alpha}")
        _check(eps >= 0, f"eps must be >= 0, got {eps}")
        _check(momentum >= 0, f"momentum must be >= 0, got {momentum}")
        _check(weight_decay >= 0, f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                                      momentum=momentum, centered=centered))

    @classmethod
    def state_bytes_per_param(cls, momentum: float = 0.0, centered: bool = False,
                              **hyper: Any) -> int:
        """4 for the square average, +4 with momentum, +4 when centered (grad average)."""
        return 4 + (4 if momentum > 0 else 0) + (4 if centered else 0)

    def _update(self, group: dict[str, Any], params: list[Tensor]) -> None:
        mom, centered = group["momentum"], group["centered"]

        def init(p: Tensor) -> dict[str, Tensor]:
            st = {"step": _step0(), "square_avg": _zeros(p)}
            if mom > 0:
                st["momentum_buffer"] = _zeros(p)
            if centered:
                st["grad_avg"] = _zeros(p)
            return st

        for p in params:
            self._state(p, init)
        for _, ps in self._count_step(params).items():
            F.rmsprop_(ps, _grads(ps), _get(ps, self.state, "square_avg"), lr=group["lr"],
                       alpha=group["alpha"], eps=group["eps"],
                       weight_decay=group["weight_decay"], momentum=mom,
                       momentum_buffer=_get(ps, self.state, "momentum_buffer") if mom > 0
                       else None, centered=centered,
                       grad_avg=_get(ps, self.state, "grad_avg") if centered else None)


class Adam(_Base):
    """Adam with L2 weight decay (g ← g + λθ) like torch.optim.Adam.

    `compiled=True` runs the update of large tensors as one torch.compile-fused pass
    (see functional.py); it needs a working inductor (a C++ compiler on CPU).
    """

    _decoupled = False

    def __init__(self, params: Params, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, compiled: bool = False) -> None:
        _check(lr >= 0, f"lr must be >= 0, got {lr}")
        _check(eps >= 0, f"eps must be >= 0, got {eps}")
        _check(weight_decay >= 0, f"weight_decay must be >= 0, got {weight_decay}")
        _check_betas(betas)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, compiled=compiled))

    @classmethod
    def state_bytes_per_param(cls, momentum: float = 0.0, **hyper: Any) -> int:
        """8: first and second moments (m, v) in fp32."""
        return 8

    def compile_probe(self) -> str | None:
        """Compile the update for every (device, dtype, group constants) this optimizer
        will meet: None when all compile, else why not (`F.adam_compile_probe`)."""
        seen = set()
        for g in self.param_groups:
            beta1, beta2 = g["betas"]
            for p in g["params"]:
                key = (p.device, p.dtype, beta1, beta2, g["weight_decay"])
                if key in seen or p.numel() < F.COMPILE_MIN_ELEMENTS:
                    continue
                seen.add(key)
                failure = F.adam_compile_probe(p.device, p.dtype, beta1=beta1, beta2=beta2,
                                               weight_decay=g["weight_decay"],
                                               decoupled=self._decoupled)
                if failure:
                    return failure
        return None

    def _update(self, group: dict[str, Any], params: list[Tensor]) -> None:
        rule = F.adamw_ if self._decoupled else F.adam_
        beta1, beta2 = group["betas"]
        if group.get("arithmetic", "zerotrain") != "zerotrain" and not self.compact.active:
            self._torch_update(group, params)  # the DeepSpeed surface's client optimizer
            return
        for p in params:
            if self.compact.active:
                self._compact_state(p, ADAM_STATES, step=True)
            else:
                self._state(p, _adam_state)
        for (_, step), ps in self._count_step(params).items():
            kw = dict(step=step, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                      weight_decay=group["weight_decay"], compiled=group["compiled"])
            if self.compact.active:
                self._compact_run(lambda P, G, M, V, kw=kw: rule(P, G, M, V, **kw), ps, ADAM_STATES,
                                  counted=True)
            else:
                rule(ps, _grads(ps), _get(ps, self.state, "exp_avg"),
                     _get(ps, self.state, "exp_avg_sq"), **kw)


    def _torch_update(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """torch.optim's own arithmetic, bit for bit (`torch_rule`): a group whose
        `arithmetic` is "torch" or "torch_fused" (what DeepSpeed would step)."""
        for p in params:
            self._state(p, _adam_state)
        beta1, beta2 = group["betas"]
        torch_adam_(params, _grads(params), _get(params, self.state, "exp_avg"),
                    _get(params, self.state, "exp_avg_sq"), _get(params, self.state, "step"),
                    rule=group["arithmetic"], lr=group["lr"], beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"],
                    decoupled=self._decoupled)


class AdamW(Adam):
    """AdamW: decoupled weight decay θ ← θ − η·λ·θ (torch's η·λ convention)."""

    _decoupled = True

    def __init__(self, params: Params, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, compiled: bool = False) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, compiled=compiled)


class Lion(_Base):
    """Lion (Chen et al. 2023): sign of an interpolated momentum, decoupled decay."""

    def __init__(self, params: Params, lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0) -> None:
        _check(lr >= 0, f"lr must be >= 0, got {lr}")
        _check(weight_decay >= 0, f"weight_decay must be >= 0, got {weight_decay}")
        _check_betas(betas)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @classmethod
    def state_bytes_per_param(cls, momentum: float = 0.0, **hyper: Any) -> int:
        """4: one momentum (exp_avg)."""
        return 4

    def _update(self, group: dict[str, Any], params: list[Tensor]) -> None:
        beta1, beta2 = group["betas"]
        kw = dict(lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"])
        if self.compact.active:
            for p in params:
                self._compact_state(p, ("exp_avg",))
            self._compact_run(lambda P, G, M: F.lion_(P, G, M, **kw), params, ("exp_avg",))
            return
        for p in params:
            self._state(p, lambda p: {"exp_avg": _zeros(p)})
        F.lion_(params, _grads(params), _get(params, self.state, "exp_avg"), **kw)
