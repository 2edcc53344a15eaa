"""What goes into a checkpoint, and how it comes back — at any world size or stage.

Each rank saves exactly what it owns: its master-weight shard of every flat unit and the
optimizer state of its optimizer tensors, plus a segment table saying which flat range
of which unit each optimizer tensor covers. That table is enough to rebuild full
per-parameter tensors without the model (`consolidate`), which gives three things:
exact resume (same layout: load the shards directly), resharding (different world size
or stage: consolidate, then cut again) and export to a plain safetensors file.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from zerotrain.checkpoint.io import (
    CheckpointError,
    read_meta,
    read_rank,
    resolve,
    save_sharded,
)

if TYPE_CHECKING:
    from zerotrain.engine import Engine

SCALAR_STATES = ("step",)  # every other optimizer state is elementwise
#: Optimizer group options that say how to compute, not what: taken from the running
#: config on resume, never from the checkpoint.
RUNTIME_OPTIONS = ("compiled",)


def _aliases(module: torch.nn.Module) -> dict[str, str]:
    """state_dict name -> canonical parameter name (tied weights share one canonical)."""
    canon: dict[int, str] = {}
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        canon.setdefault(id(p), name)
        out[name] = canon[id(p)]
    return out


# ----------------------------------------------------------------------------- save


def save_engine(engine: Engine, root: str | Path, extra: dict[str, Any] | None = None) -> Path:
    s, opt = engine.strategy, engine.optimizer
    tensors: dict[str, Tensor] = dict(s.master_shards())
    sd = opt.state_dict()
    scalars: dict[str, Any] = {}
    for idx, st in sd["state"].items():
        for name, v in st.items():
            if isinstance(v, Tensor):
                tensors[f"optim.{idx}.{name}"] = v
            else:
                scalars[f"{idx}.{name}"] = v
    tensors["rng.cpu"] = torch.get_rng_state()
    if engine.device.type == "cuda":
        tensors["rng.cuda"] = torch.cuda.get_rng_state(engine.device)
    if engine.rank == 0:
        param_ids = {id(p) for p in engine.module.parameters()}
        for name, b in engine.module.state_dict(keep_vars=True).items():
            if id(b) not in param_ids and isinstance(b, Tensor):
                tensors[f"buffer.{name}"] = b
    rank_meta = {
        "segments": s.segment_table(),
        "opt_ranges": [list(s.opt_range(u)) for u in s.units],
        "param_groups": sd["param_groups"],
        "scalar_state": scalars,
    }
    meta = {
        "config": engine.config.to_dict(),
        "layout": s.layout(),
        "aliases": _aliases(engine.module),
        "global_step": engine.global_step,
        "micro_step": engine.micro_step,
        "scaler": engine.scaler.state_dict(),
        **(extra or {}),
    }
    return save_sharded(root, engine.global_step, engine.rank, engine.world_size, tensors,
                        rank_meta, meta, engine.config.checkpoint.keep)


# ----------------------------------------------------------------------------- load


def _check_model(meta: dict, engine: Engine) -> None:
    saved = meta["config"]["model"]
    now = engine.config.model.model_dump(mode="json")
    diff = [f"model.{k}: checkpoint {saved.get(k)!r}, config {v!r}"
            for k, v in now.items() if saved.get(k) != v]
    if diff:
        raise CheckpointError("the checkpoint was trained with a different model (" +
                              "; ".join(diff) + "); use the checkpoint's model settings")


def load_engine(engine: Engine, path: str | Path) -> dict[str, Any]:
    """Restore weights, optimizer, scaler and counters; returns the checkpoint's meta."""
    ckpt = resolve(path)
    meta = read_meta(ckpt)
    _check_model(meta, engine)
    s, opt = engine.strategy, engine.optimizer
    same_layout = meta["layout"] == s.layout()
    tensors: dict[str, Tensor] | None = None
    if same_layout:
        tensors, rmeta = read_rank(ckpt, engine.rank)
        # Same units, but the optimizer tensors cut differently (stage 0 used to hand the
        # optimizer one tensor per parameter, now one flat run per group): the weights are
        # the same, so reshard the optimizer state. The cut follows from the layout and
        # the optimizer alone, so every rank takes the same branch (both branches run
        # collectives).
        same_layout = rmeta["segments"] == s.segment_table()
    if same_layout:
        assert tensors is not None
        s.load_master_shards(tensors)
        state: dict[int, dict[str, Any]] = {}
        for key, v in tensors.items():
            if key.startswith("optim."):
                _, idx, name = key.split(".", 2)
                state.setdefault(int(idx), {})[name] = v
        for key, v in rmeta["scalar_state"].items():
            idx, name = key.split(".", 1)
            state.setdefault(int(idx), {})[name] = v
        opt.load_state_dict({"state": state, "param_groups": rmeta["param_groups"]})
        # how to run the update is this run's choice, not the checkpoint's
        for g in opt.param_groups:
            g.update({k: v for k, v in opt.defaults.items() if k in RUNTIME_OPTIONS})
    else:
        weights, states, _ = consolidate(ckpt)
        _load_resharded(engine, weights, states)
    if tensors is not None:  # this rank's own generator state (same world size)
        torch.set_rng_state(tensors["rng.cpu"])
        if "rng.cuda" in tensors and engine.device.type == "cuda":
            torch.cuda.set_rng_state(tensors["rng.cuda"], engine.device)
    engine.global_step = int(meta["global_step"])
    engine.micro_step = int(meta["micro_step"])
    engine.scaler.load_state_dict(meta["scaler"])
    return meta


def _load_resharded(engine: Engine, weights: dict[str, Tensor],
                    states: dict[str, dict[str, Tensor]]) -> None:
    """Cut consolidated per-parameter tensors along this engine's own layout."""
    s, opt = engine.strategy, engine.optimizer

    def gather_range(u, lo: int, hi: int, source: dict[str, Tensor], dtype) -> Tensor:
        out = torch.zeros(hi - lo, dtype=dtype)
        for slot in u.slots:
            a, b = max(lo, slot.offset), min(hi, slot.end)
            if a < b:
                if slot.name not in source:
                    raise CheckpointError(f"the checkpoint has no tensor for '{slot.name}'")
                flat = source[slot.name].reshape(-1)
                out[a - lo:b - lo] = flat[a - slot.offset:b - slot.offset]
        return out

    with torch.no_grad():
        for u in s.units:
            lo, hi = s.opt_range(u)
            s.master[u.index].copy_(gather_range(u, lo, hi, weights, s.master[u.index].dtype))
        for u in s.units:
            s.publish(u)
        s.wait_pending()
    new_state: dict[int, dict[str, Tensor]] = {}
    for idx, (seg, view) in enumerate(s.opt_segments):
        u = s.units[seg.unit]
        names = {n for slot in u.slots if slot.offset < seg.end and slot.end > seg.start
                 for n in states.get(slot.name, {})}
        st: dict[str, Tensor] = {}
        for name in sorted(names):
            if name in SCALAR_STATES:
                slot = next(sl for sl in u.slots if sl.offset < seg.end and sl.end > seg.start
                            and name in states.get(sl.name, {}))
                st[name] = states[slot.name][name].clone()
            else:
                src = {k: v[name] for k, v in states.items() if name in v}
                st[name] = gather_range(u, seg.start, seg.end, src, view.dtype).view(view.shape)
        if st:
            new_state[idx] = st
    opt.load_state_dict({"state": new_state, "param_groups": opt.state_dict()["param_groups"]})


# ----------------------------------------------------------------------------- consolidate


def consolidate(path: str | Path, optimizer: bool = True
                ) -> tuple[dict[str, Tensor], dict[str, dict[str, Tensor]], dict[str, Any]]:
    """Full per-parameter master weights (and optimizer states) from every rank's shards."""
    ckpt = resolve(path)
    meta = read_meta(ckpt)
    layout = meta["layout"]
    units = layout["units"]
    full: list[Tensor | None] = [None] * len(units)
    full_states: list[dict[str, Tensor]] = [{} for _ in units]
    scalar_states: list[list[tuple[int, int, str, Tensor]]] = [[] for _ in units]
    buffers: dict[str, Tensor] = {}  # non-parameter state, saved by rank 0 only
    for r in range(layout["world_size"]):
        tensors, rmeta = read_rank(ckpt, r)
        buffers.update({k.removeprefix("buffer."): v for k, v in tensors.items()
                        if k.startswith("buffer.")})
        for ui, (lo, hi) in enumerate(rmeta["opt_ranges"]):
            shard = tensors[f"master.{ui}"]
            if full[ui] is None:
                full[ui] = torch.zeros(units[ui]["padded_numel"], dtype=shard.dtype)
            full[ui][lo:hi] = shard
        if not optimizer:
            continue
        for key, v in tensors.items():
            if not key.startswith("optim."):
                continue
            _, idx, name = key.split(".", 2)
            ui, a, b = rmeta["segments"][int(idx)]
            if name in SCALAR_STATES:
                scalar_states[ui].append((a, b, name, v))
                continue
            buf = full_states[ui].setdefault(
                name, torch.zeros(units[ui]["padded_numel"], dtype=v.dtype))
            buf[a:b] = v.reshape(-1)
    weights: dict[str, Tensor] = {}
    states: dict[str, dict[str, Tensor]] = {}
    for ui, u in enumerate(units):
        for name, shape, off, _group in u["params"]:
            n = int(torch.Size(shape).numel())
            weights[name] = full[ui][off:off + n].view(shape)
            st = {k: buf[off:off + n].view(shape) for k, buf in full_states[ui].items()}
            for a, b, sname, v in scalar_states[ui]:
                if a < off + n and b > off:
                    st[sname] = v
            if st:
                states[name] = st
    weights.update(buffers)
    return weights, states, meta


def full_state_dict(path: str | Path, dtype: torch.dtype | None = torch.float32
                    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A plain `model.state_dict()` (tied names included) from a sharded checkpoint."""
    weights, _, meta = consolidate(path, optimizer=False)
    out = {}
    for name, canon in meta["aliases"].items():
        out[name] = weights[canon]
    for k, v in weights.items():
        out.setdefault(k, v)
    if dtype is not None:
        out = {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}
    return out, meta


def export(path: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write consolidated weights as one safetensors file a plain model can load."""
    sd, meta = full_state_dict(path, dtype)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file({k: v.contiguous().clone() for k, v in sd.items()}, str(tmp),
              metadata={"step": str(meta["global_step"]), "format": "zerotrain-export"})
    tmp.replace(out)
    return out
