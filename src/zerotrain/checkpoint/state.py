"""Saving and restoring a Stateful object (the engine) through its state dict.

`save(state, ...)` flattens an engine-shaped state dict into this rank's safetensors
file (tensors, optimizer tensors flat) and JSON (its cut of the layout, optimizer groups,
scalars); rank 0 adds the manifest. A rank writes only its `write_ranges` (its shard:
replicated stage-0 state is written once, split across the ranks).

`load(path, template, rank)` returns a state dict shaped like `template` (the running
engine's own `state_dict()`): read straight from this rank's file when it holds exactly
this rank's cut, cut again from every rank's files (`reshard.py`) otherwise — another
world size or stage, or stage 0 at N > 1. This module never sees the engine itself,
only state dicts.

One rule for what a resume takes from where: the checkpoint gives the *state* (weights,
optimizer moments and step counts, loss scale, counters, RNG when the world size is the
same); the config gives every *setting* (learning rate and schedule, betas, decay …).
`config_changes` lists the settings that differ, so the caller can say so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor

from zerotrain.checkpoint import client_state as client_states
from zerotrain.checkpoint import stream
from zerotrain.checkpoint.compact import (
    Q8,
    block_layout,
    conversion_notes,
    dequantizing_reader,
    is_blocks,
    saved_dtype,
    wants_int8,
)
from zerotrain.checkpoint.io import (
    CheckpointError,
    rank_files,
    read_json,
    read_meta,
    resolve,
    save_sharded,
    verify,
)
from zerotrain.checkpoint.reshard import SCALAR_STATES, SavedShards
from zerotrain.numerics.blockquant import BLOCK, n_blocks
from zerotrain.zero.flat import gather_range
from zerotrain.zero.tiers.lazy import Lazy, flat_slice

#: Optimizer group options that say how to compute, not what: never compared.
RUNTIME_OPTIONS = ("compiled",)
#: Config fields whose change on resume alters the optimization or the data trained on
#: (warned about).
WATCHED = ("optimizer", "schedule", "train.steps", "data.micro_batch_size",
           "data.grad_accum_steps", "precision.dtype", "precision.master_dtype",
           "precision.master_update", "data.path", "data.val_fraction", "data.tokenizer",
           "data.text_field")


@dataclass
class Loaded:
    path: Path
    meta: dict[str, Any]
    resharded: bool
    optimizer_reset: bool = False
    client_state: Any = None
    changes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # compact states converted, and how


# ----------------------------------------------------------------------------- save


def save(state: dict[str, Any], root: str | Path, *, step: int, rank: int, world: int,
         keep: int, run_id: str | None = None, client_state: Any = None,
         name: str | None = None, latest: bool = True) -> Path:
    """Collective: write `state` (an engine state dict) as one sharded checkpoint;
    `latest=False` leaves the root's `latest` file as it was."""
    tensors, scalars, cut = _written_part(state)
    tensors.update({f"rng.{k}": v for k, v in state["rng"].items()})
    if rank == 0:
        tensors.update({f"buffer.{k}": v for k, v in state["buffers"].items()})
    meta_in = state["meta"]
    rank_meta = {**cut, "param_groups": state["optimizer"]["param_groups"],
                 "scalar_state": scalars}
    client_state = client_states.encode(client_state)
    meta = {"config": meta_in["config"], "layout": meta_in["layout"],
            "aliases": meta_in["aliases"], "optimizer": meta_in["optimizer"],
            "extra": meta_in.get("extra", {}),
            "scaler": state["scaler"], **state["counters"], "run_id": run_id,
            "client_state": client_state}
    return save_sharded(root, step, rank, world, tensors, rank_meta, meta, keep, name, latest)


def _written_part(state: dict[str, Any]) -> tuple[dict[str, Tensor | Lazy], dict[str, Any],
                                                 dict]:
    """(tensors, scalar optimizer state, cut) of what this rank writes: of each unit only
    its `write_ranges` — all it holds at stages 1–3, its shard of the replicated state at
    stage 0 — and the cut (`opt_ranges`, `segments`) describing exactly that, which is
    all a reader goes by. Optimizer tensors reaching outside the master range (Muon's
    owners hold whole matrices) are written whole: no other rank has them."""
    cut = state["meta"]["rank_layout"]
    held = [tuple(r) for r in cut["opt_ranges"]]
    write = [tuple(r) for r in cut.get("write_ranges", held)]
    tensors: dict[str, Tensor | Lazy] = {}
    for k, v in state["strategy"].items():
        if k.startswith("master."):
            ui = int(k.split(".")[1])
            (lo, _), (a, b) = held[ui], write[ui]
            v = flat_slice(v, a - lo, b - lo)
        tensors[f"strategy.{k}"] = v
    segments = []
    for ui, a, b, shape in cut["segments"]:
        x, y = (a, b) if write[ui] == held[ui] else (max(a, write[ui][0]), min(b, write[ui][1]))
        y = max(x, y)
        segments.append([ui, a, b, shape] if (x, y) == (a, b) else [ui, x, y, [y - x]])
    scalars: dict[str, Any] = {}
    for idx, st in state["optimizer"]["state"].items():
        a = cut["segments"][idx][1]
        _, x, y, _ = segments[idx]
        if x == y:  # none of this tensor is this rank's to write
            continue
        for n, v in st.items():
            if not isinstance(v, (Tensor, Lazy)):
                scalars[f"{idx}.{n}"] = v
            elif is_blocks(n):  # int8 block scales: blocks [x, y) (x, a start blocks)
                tensors[f"optim.{idx}.{n}"] = flat_slice(v, (x - a) // BLOCK, n_blocks(y - a))
            else:
                tensors[f"optim.{idx}.{n}"] = flat_slice(v, x - a, y - a) if v.ndim else v
    return tensors, scalars, {"opt_ranges": [list(r) for r in write], "segments": segments}


# ----------------------------------------------------------------------------- load


def load(path: str | Path, template: dict[str, Any], rank: int,
         reset_optimizer: bool = False) -> tuple[dict[str, Any], Loaded]:
    """A state dict in `template`'s layout from the checkpoint at `path`. Where the
    template's states are `Lazy` (they live in an offload tier), so are the returned
    masters and optimizer tensors: each is read from the files when its unit is filled."""
    ckpt = resolve(path)
    lazy = any(isinstance(v, Lazy) for v in template["strategy"].values())
    meta = read_meta(ckpt)
    check_model(meta["layout"], template["meta"]["layout"],
                order=list(template["meta"]["aliases"].values()))
    reset = check_optimizer(meta, template["meta"]["optimizer"], reset_optimizer)
    layout = template["meta"]["layout"]
    same_world = meta["world_size"] == layout["world_size"]
    same = same_world and meta["layout"]["units"] == layout["units"]
    topology = same and meta["layout"].get("stage") == layout.get("stage")
    tensors: dict[str, Tensor] = {}
    rmeta: dict[str, Any] = {}
    if same:
        tensors, rmeta = _read_rank(ckpt, meta, rank, lazy)
        # the same units can still be cut differently for the optimizer (e.g. Muon keeps
        # per-matrix tensors), or written in parts (stage 0 at N > 1: each rank wrote a
        # slice of the replicated state); that follows from layout and optimizer alone,
        # so every rank takes the same branch
        same = _cut(rmeta) == _cut(template["meta"]["rank_layout"])
    if same:
        sd = _same_layout(tensors, rmeta, template)
    else:  # the RNG streams carry over where rank r of the checkpoint is rank r here
        sd = resliced(SavedShards(ckpt, meta), template, rank if same_world else None, lazy)
    if reset:
        sd["optimizer"] = {"state": {}}
    sd.update(scaler=meta["scaler"],
              counters={"global_step": int(meta["global_step"]),
                        "micro_step": int(meta["micro_step"]),
                        "spike_guard": meta.get("spike_guard")})
    client = client_states.decode(meta.get("client_state"))
    info = Loaded(ckpt, meta, not topology, reset, client,
                  config_changes(meta.get("config", {}), template["meta"]["config"]),
                  conversion_notes(meta.get("config", {}), template["meta"]["config"]))
    return sd, info


def _cut(rank_layout: dict) -> tuple:
    return ([list(r) for r in rank_layout["opt_ranges"]],
            [list(s[:3]) for s in rank_layout["segments"]])


def _read_rank(ckpt: Path, meta: dict, rank: int, lazy: bool = False
               ) -> tuple[dict[str, Tensor | Lazy], dict]:
    st, js = rank_files(ckpt, rank)
    if not st.is_file() or not js.is_file():
        raise CheckpointError(f"'{ckpt}' lacks the files of rank {rank} ({st.name}); the "
                              "checkpoint is incomplete")
    verify(ckpt, meta, [st, js])
    rmeta = read_json(js)
    for k in ("opt_ranges", "segments", "param_groups"):
        if k not in rmeta:
            raise CheckpointError(f"'{js}' is damaged: it lacks '{k}'")
    try:
        if lazy:
            return _lazy_file(st), rmeta
        return load_file(st), rmeta
    except Exception as e:  # safetensors' own errors: name the file, not the parser
        raise CheckpointError(f"'{st}' is damaged ({e})") from None


def _lazy_file(st: Path) -> dict[str, Tensor | Lazy]:
    """The file's tensors; masters and elementwise optimizer states as `Lazy` ones, each
    read (safetensors reads one key) only when loaded."""
    f = safe_open(str(st), "pt")
    dtypes = {v: k for k, v in stream.NAMES.items()}
    out: dict[str, Tensor | Lazy] = {}
    names = f.keys()
    for k in names:
        if k.startswith(("strategy.", "optim.")) and k.split(".")[-1] not in SCALAR_STATES:
            sl = f.get_slice(k)
            out[k] = Lazy(sl.get_shape(), dtypes[sl.get_dtype()], partial(f.get_tensor, k))
        else:
            out[k] = f.get_tensor(k)
    return out


def _same_layout(tensors: dict[str, Tensor], rmeta: dict, template: dict) -> dict[str, Any]:
    strategy = {k: tensors[f"strategy.{k}"] for k in template["strategy"]}
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".", 2)
            shape = template["meta"]["rank_layout"]["segments"][int(idx)][3]
            flat = name in SCALAR_STATES or is_blocks(name)
            state.setdefault(int(idx), {})[name] = v if flat else v.view(shape)
    for key, v in rmeta.get("scalar_state", {}).items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    rng = {k.removeprefix("rng."): v for k, v in tensors.items() if k.startswith("rng.")}
    buffers = {k.removeprefix("buffer."): v for k, v in tensors.items()
               if k.startswith("buffer.")}
    return {"strategy": strategy, "optimizer": {"state": state}, "rng": rng,
            "buffers": buffers}


def resliced(saved: SavedShards, template: dict, rng_rank: int | None = None,
             lazy: bool = False) -> dict[str, Any]:
    """Cut saved full-parameter state along the template's layout, reading only this
    rank's ranges. `saved`: every rank's shards of a checkpoint (`SavedShards`), or any
    object with its reader(kind), state_names(params), scalars and buffers() (a DeepSpeed
    checkpoint: zerotrain/deepspeed/checkpoint.py). The RNG comes from rank `rng_rank`'s
    file when given (the same world size); otherwise it is not carried over: rank r of
    another world size is another stream. `lazy`: masters and elementwise states as
    `Lazy` tensors, each cut from the files when loaded."""
    layout, cut = template["meta"]["layout"], template["meta"]["rank_layout"]
    strategy: dict[str, Tensor] = {}
    for ui, unit in enumerate(layout["units"]):
        lo, hi = cut["opt_ranges"][ui]
        dtype = template["strategy"][f"master.{ui}"].dtype
        strategy[f"master.{ui}"] = _ranged(lazy, [hi - lo], unit, lo, hi, saved.reader("master"),
                                           dtype)
    state: dict[int, dict[str, Any]] = {}
    for idx, (ui, a, b, shape) in enumerate(cut["segments"]):
        unit = layout["units"][ui]
        params = [p[0] for p in unit["params"]
                  if p[2] < b and p[2] + torch.Size(p[1]).numel() > a]
        st: dict[str, Any] = {}
        int8 = wants_int8(template, unit, a)
        for name in saved.state_names(params):
            if name.endswith(Q8) and not int8:  # int8 into another form: values
                name, read = name.removesuffix(Q8), dequantizing_reader(saved, name)
                st[name] = _ranged(lazy, shape, unit, a, b, read, torch.float32)
            elif is_blocks(name) and not int8:
                continue  # read with the codes above
            elif name in SCALAR_STATES:
                value = next(saved.scalars[(name, p)] for p in params
                             if (name, p) in saved.scalars)
                st[name] = torch.tensor(float(value), dtype=torch.float32)
            elif is_blocks(name):  # int8 block scales, cut in block coordinates
                st[name] = _ranged(lazy, [n_blocks(b) - a // BLOCK], block_layout(unit),
                                   a // BLOCK, n_blocks(b), saved.reader(name), torch.float32)
            else:  # the saved dtype where it is a compact form (int8 codes, bf16)
                dtype = saved_dtype(saved, name, params) or strategy[f"master.{ui}"].dtype
                st[name] = _ranged(lazy, shape, unit, a, b, saved.reader(name), dtype)
        if st:
            state[idx] = st
    rng = {} if rng_rank is None else saved.rank_tensors(rng_rank, "rng.")
    return {"strategy": strategy, "optimizer": {"state": state}, "rng": rng,
            "buffers": saved.buffers()}


def _ranged(lazy: bool, shape: list[int], unit: dict, a: int, b: int, read: Any,
            dtype: torch.dtype) -> Tensor | Lazy:
    """Elements [a, b) of `unit` from `read`, in `shape` (as a `Lazy` tensor if `lazy`)."""
    def cut() -> Tensor:
        return gather_range(unit, a, b, read, dtype).view(shape)
    return Lazy(shape, dtype, cut) if lazy else cut()


# ----------------------------------------------------------------------------- checks


def check_model(saved: dict, current: dict, order: list[str] | None = None) -> None:
    """Same parameter names and shapes, or one CheckpointError naming the first that
    differs (in `order`, the model's own parameter order, when given).

    Settings that change no shape (dropout, activation checkpointing) never block.
    """
    def shapes(layout: dict) -> dict[str, list[int]]:
        return {p[0]: list(p[1]) for u in layout["units"] for p in u["params"]}

    a, b = shapes(saved), shapes(current)
    names = [n for n in dict.fromkeys(order or []) if n in b] + sorted(set(b) - set(order or []))
    for name in names:
        shape = b[name]
        if name not in a:
            raise CheckpointError(f"the checkpoint has no tensor '{name}' (shape {shape}): "
                                  "it was saved from a different model")
        if a[name] != shape:
            raise CheckpointError(f"tensor '{name}' has shape {a[name]} in the checkpoint "
                                  f"but {shape} in this model: it was saved from a "
                                  "different model")
    extra = sorted(set(a) - set(b))
    if extra:
        raise CheckpointError(f"the checkpoint has tensor '{extra[0]}', which this model "
                              "lacks: it was saved from a different model")


def check_optimizer(meta: dict, current: str, reset: bool) -> bool:
    """True when the optimizer state must be dropped (asked for, with another optimizer)."""
    saved = meta.get("optimizer") or meta.get("config", {}).get("optimizer", {}).get("name")
    if saved is None or saved == current:
        return reset
    if not reset:
        raise CheckpointError(
            f"the checkpoint was trained with optimizer '{saved}', this run uses '{current}'; "
            "its state cannot carry over. Use the same optimizer, or reset the optimizer "
            "state (--checkpoint.reset_optimizer true)")
    return True


def config_changes(saved: dict, current: dict) -> list[str]:
    """'section.key: checkpoint X → config Y' for each watched setting that differs."""
    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(d, dict):
            return {prefix[:-1]: d}
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}."))
        return out

    a, b = flat(saved), flat(current)
    out = []
    for key in sorted(b):
        watched = any(key == w or key.startswith(w + ".") for w in WATCHED)
        if watched and key.split(".")[-1] not in RUNTIME_OPTIONS and key in a and a[key] != b[key]:
            out.append(f"{key}: checkpoint {a[key]!r} → config {b[key]!r}")
    return out
