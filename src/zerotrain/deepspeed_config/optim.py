"""DeepSpeed's `optimizer` and `scheduler` sections as zerotrain's optimizer and schedule.

Optimizers take DeepSpeed's defaults for what the JSON leaves out: those of the class
DeepSpeed would build (FusedAdam / CPU Adam, FusedLion, its Muon, torch.optim's
Adagrad, SGD and RMSprop). DeepSpeed's "Adam" is AdamW unless `adam_w_mode` is false,
and DeepSpeed decays every parameter it is given, so `optimizer.decay_1d` is set.

Schedules are exact: zerotrain's `lr_at(s)` equals the value DeepSpeed's scheduler
holds at `last_batch_iteration = s`, for every s (tests/test_deepspeed_config.py holds
the two against each other). With W = max(2, warmup_num_steps) as DeepSpeed uses and
g(s) = log(s+1)/log(W) ("log", DeepSpeed's default) or s/W ("linear"):
- WarmupLR:       min + (max−min)·g(s) for s < W, then max
                  -> constant, warmup W from warmup_min_lr, peak warmup_max_lr
- WarmupDecayLR:  as WarmupLR, then min + (max−min)·(T−s)/(T−W) down to min at T
                  -> linear, decay_steps T−W, min_lr warmup_min_lr
- WarmupCosineLR: lr·(r0 + (1−r0)·g(s)) for s < W, then
                  lr·(rc + (1−rc)·(1 + cos(π·min(1, (s−W+1)/(T−W))))/2)
                  -> cosine from decay_start W−1 over T−W steps, peak = optimizer lr
WarmupLR and WarmupDecayLR overwrite the optimizer's lr: their warmup_max_lr is the
peak. WarmupLR's default peak is the optimizer's lr, WarmupDecayLR's is 0.001.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerotrain.deepspeed_config.reader import Reader

_ADAM = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
#: DeepSpeed optimizer type (lower case) -> zerotrain name and the defaults DeepSpeed uses
_TYPES: dict[str, tuple[str, dict[str, Any]]] = {
    "adam": ("adamw", _ADAM),
    "adamw": ("adamw", _ADAM),
    "lion": ("lion", {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.0}),
    "muon": ("muon", {"momentum": 0.95, "weight_decay": 0.0, "betas": [0.9, 0.95],
                      "eps": 1e-10}),
    "adagrad": ("adagrad", {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0, "lr_decay": 0.0}),
    "sgd": ("sgd", {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0,
                    "nesterov": False}),
    "rmsprop": ("rmsprop", {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0,
                            "momentum": 0.0}),
}
_KINDS = {"lr": float, "eps": float, "weight_decay": float, "lr_decay": float,
          "momentum": float, "dampening": float, "alpha": float, "nesterov": bool}
MUON_LR, MUON_ADAM_LR = 0.02, 3e-4  # DeepSpeed's Muon: lr of the matrices / AdamW group


def _betas(r: Reader, path: str, default: list[float]) -> list[float]:
    v = r.raw(path, None)
    if v is None:
        return default
    if v == "auto":
        return r.get(path, default, auto="optimizer.betas")
    if (not isinstance(v, list) or len(v) != 2
            or any(isinstance(b, bool) or not isinstance(b, int | float) for b in v)):
        r.problem(path, "must be a list of two numbers")
        return default
    return [float(b) for b in v]


def _muon_lr(r: Reader, opt: dict[str, Any]) -> float | None:
    """DeepSpeed's Muon has a matrix lr and an AdamW lr; zerotrain's one lr serves both."""
    p = "optimizer.params."
    base = r.get(p + "lr", None, auto="optimizer.lr")
    muon = r.get(p + "muon_lr", base if base is not None else MUON_LR, auto="optimizer.lr")
    adam = r.get(p + "adam_lr", base if base is not None else MUON_ADAM_LR, auto="optimizer.lr")
    if muon != adam:
        r.problems.append(f"optimizer (Muon): the matrices would train at lr {muon} and the "
                          f"AdamW fallback at {adam}; zerotrain's Muon has one lr for both: "
                          "set optimizer.params.lr (or muon_lr and adam_lr equal)")
        return None
    opt["muon_adjust_lr"] = "original"  # DeepSpeed scales by √max(1, rows/cols)
    return muon


def map_optimizer(r: Reader) -> dict[str, Any] | None:
    """The zerotrain `optimizer:` section, or None if DeepSpeed's config names none."""
    if "optimizer" not in r.data:
        r.notes.append("optimizer: none in the DeepSpeed config; zerotrain builds its own "
                       "optimizer from the `optimizer:` section (default adamw)")
        return None
    typ = r.get("optimizer.type", "", str)
    if typ.lower() not in _TYPES:
        r.problem("optimizer.type", "zerotrain maps Adam, AdamW, Lion, Muon, Adagrad, SGD and "
                                    "RMSprop")
        return None
    name, defaults = _TYPES[typ.lower()]
    p = "optimizer.params."
    if r.raw(p + "max_grad_norm", None) is not None:
        r.problem(p + "max_grad_norm", "use the top-level gradient_clipping (as DeepSpeed says)")
    opt: dict[str, Any] = {"name": name, "decay_1d": True}
    if typ.lower() == "adam" and not r.get(p + "adam_w_mode", True, bool):
        opt["name"] = "adam"  # classic Adam, weight decay as L2 in the gradient
    elif typ.lower() == "adamw":
        r.get(p + "adam_w_mode", True, bool)  # DeepSpeed's AdamW ignores it
    if name == "adamw" and opt["name"] == "adamw" and r.raw(p + "torch_adam", False) is True:
        defaults = {**defaults, "weight_decay": 0.01}  # torch.optim.AdamW's default
    for key, default in defaults.items():  # Muon's lr is read by _muon_lr
        if key == "betas":
            opt[key] = _betas(r, p + key, default)
        else:
            opt[key] = r.get(p + key, default, _KINDS[key], auto=f"optimizer.{key}")
    if name == "muon":
        lr = _muon_lr(r, opt)
        if lr is None:
            return None
        opt["lr"] = lr
    return opt


def _warmup(r: Reader) -> tuple[int, str] | None:
    """(warmup steps as DeepSpeed uses them, warmup type), or None after a problem."""
    p = "scheduler.params."
    w = r.get(p + "warmup_num_steps", 1000, int, auto="schedule.warmup_steps")
    if w < 1:
        r.problem(p + "warmup_num_steps", "must be >= 1 (DeepSpeed refuses 0 too)")
        return None
    wtype = r.get(p + "warmup_type", "log", str)
    if wtype not in ("log", "linear"):
        r.problem(p + "warmup_type", "must be log or linear")
        return None
    if w == 1:
        r.notes.append(f"{p}warmup_num_steps: 1 -> 2 (DeepSpeed warms up over at least 2 steps)")
    return max(2, w), wtype


def _total(r: Reader, warmup: int) -> int | None:
    path = "scheduler.params.total_num_steps"
    if r.raw(path, None) is None:
        r.problems.append(f"{path} is required by this scheduler")
        return None
    total = r.get(path, 0, int, auto="train.steps")
    if total <= warmup:
        r.problem(path, f"must exceed the warmup ({warmup} steps) for a decay to follow")
        return None
    return total


def map_scheduler(r: Reader, opt_lr: float) -> tuple[dict[str, Any], float, int | None]:
    """(zerotrain `schedule:` section, peak lr for `optimizer.lr`, train.steps or None)."""
    if "scheduler" not in r.data:  # DeepSpeed: the optimizer's lr, constant
        return {"kind": "constant", "warmup_steps": 0, "min_lr": 0.0}, opt_lr, None
    typ = r.get("scheduler.type", "", str)
    p = "scheduler.params."
    if typ not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        r.problem("scheduler.type", "zerotrain maps WarmupLR, WarmupDecayLR and WarmupCosineLR")
        return {}, opt_lr, None
    warmup = _warmup(r)
    if warmup is None:
        return {}, opt_lr, None
    w, wtype = warmup
    if typ == "WarmupCosineLR":
        total = _total(r, w)
        r0 = r.get(p + "warmup_min_ratio", 0.0)
        rc = r.get(p + "cos_min_ratio", 1e-4)
        for key, v in (("warmup_min_ratio", r0), ("cos_min_ratio", rc)):
            if not 0.0 <= v <= 1.0:
                r.problem(p + key, "must lie in [0, 1] (a fraction of the optimizer's lr)")
        if total is None:
            return {}, opt_lr, None
        return {"kind": "cosine", "warmup_steps": w, "warmup_type": wtype,
                "warmup_start_lr": r0 * opt_lr, "min_lr": rc * opt_lr,
                "decay_start": w - 1, "decay_steps": total - w}, opt_lr, total
    peak = r.get(p + "warmup_max_lr", opt_lr if typ == "WarmupLR" else 1e-3, auto="optimizer.lr")
    low = r.get(p + "warmup_min_lr", 0.0, auto="schedule.warmup_start_lr")
    if not 0.0 <= low <= peak:
        r.problem(p + "warmup_min_lr", f"must lie in [0, warmup_max_lr = {peak}]")
    sched = {"kind": "constant", "warmup_steps": w, "warmup_type": wtype,
             "warmup_start_lr": low, "min_lr": low}
    given = r.data.get("optimizer", {}).get("params", {})
    if isinstance(given, dict) and "lr" in given and peak != opt_lr:
        r.notes.append(f"optimizer.params.lr ({opt_lr}): DeepSpeed's {typ} overrides it; "
                       f"the peak is warmup_max_lr ({peak})")
    if typ == "WarmupLR":
        return sched, peak, None
    total = _total(r, w)
    if total is None:
        return {}, peak, None
    return {**sched, "kind": "linear", "decay_steps": total - w}, peak, total
