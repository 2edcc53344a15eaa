"""DeepSpeed's own checkpoints, read into a zerotrain engine (a run migrating mid-way).

A DeepSpeed 0.19 checkpoint folder holds `latest` (the tag) and `<tag>/`, with
`mp_rank_00_model_states.pt` (module weights, lr scheduler, step counters, client state)
and, at ZeRO stages 1-3, one `zero_pp_rank_<r>_mp_rank_00_optim_states.pt` per rank
(fp32 master partitions and optimizer moments, flat per group). They are pickles: every
file is read with `torch.load(weights_only=True)` and an explicit allow-list of the few
non-tensor types DeepSpeed writes; anything else is refused in one line.

What is read: the fp32 master weights, every elementwise optimizer state (Adam's
exp_avg / exp_avg_sq, ...) and its step, the scheduler position, the groups' lr and the
step counters. They are put back together whole per parameter (DeepSpeed's files are
read in full, on every rank), then cut for this engine's stage and world size by the
same code that reshards zerotrain checkpoints (`checkpoint.state.resliced`).
"""

from __future__ import annotations

import enum
import math
import re
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zerotrain.checkpoint.io import DEEPSPEED_MODEL_FILES, CheckpointError

MODEL_FILES = DEEPSPEED_MODEL_FILES  # stages 0-2; stage 3 (rank 0's)
#: model-states keys DeepSpeed writes itself; the rest is the script's client_state
_DS_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
            "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler",
            "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps",
            "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
            "checkpoint_parallel_dimensions", "ds_config_hash"}


class _Stand_in(enum.IntEnum):
    """Stands for DeepSpeed's `ZeroStageEnum` (an IntEnum): read as its int."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class _Record:
    """Stands for DeepSpeed's small bookkeeping objects (loss scalers, fragment addresses):
    their attributes, nothing more; zerotrain reads none of them."""


#: DeepSpeed's non-tensor pickled types, mapped to stand-ins (no DeepSpeed import needed)
ALLOWED: list[Any] = [
    (_Stand_in, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_Record, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_Record, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_Record, "deepspeed.utils.tensor_fragment.fragment_address"),
    OrderedDict, torch.Size,
]


def find(load_dir: str | Path, tag: str | None) -> Path | None:
    """The folder of a DeepSpeed checkpoint (through `latest` or `tag`), else None."""
    root = Path(load_dir)
    if tag is None and (root / "latest").is_file():
        try:
            tag = (root / "latest").read_bytes().decode("utf-8").strip()
        except (OSError, UnicodeDecodeError):
            tags = tags_in(root)
            if not tags:
                return None  # not a DeepSpeed folder: zerotrain's reader says what is wrong
            raw = (root / "latest").read_bytes()[:40]
            raise CheckpointError(f"'{root}/latest' is damaged (it names no folder: {raw!r}); "
                                  f"its tags: {', '.join(tags)}: pass one with --tag (tag=)"
                                  ) from None
    for folder in (root, root / str(tag)) if tag is not None else (root,):
        if any((folder / f).is_file() for f in MODEL_FILES):
            return folder
    return None


def tags_in(root: Path) -> list[str]:
    """The folders under `root` that hold a DeepSpeed checkpoint."""
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir()
                  if d.is_dir() and any((d / f).is_file() for f in MODEL_FILES))


def read(path: Path) -> Any:
    """torch.load with weights_only=True and DeepSpeed's allow-list; one line if refused."""
    try:
        with torch.serialization.safe_globals(ALLOWED):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"'{path}' cannot be read safely (weights_only=True with "
                              f"DeepSpeed's allow-list): {_refusal(e)}") from None


def _refusal(e: Exception) -> str:
    """torch's weights_only refusal in a few words: the global it refused (its code never
    ran), or the damage it met — not its advice to load with weights_only=False."""
    text = str(e)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        blocked = " (its module is blocked)" if "is blocked" in text else ""
        return f"{found.group(1)} is not on the allow-list{blocked}; nothing in it ran"
    boiler = ("Weights only load failed", "Please file an issue", "Check the documentation",
              "In PyTorch 2.6")
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not ln.strip().startswith(boiler)]
    what = lines[0] if lines else type(e).__name__
    return f"{what}: the file is damaged or not a DeepSpeed checkpoint file"


def check_shapes(saved: dict[str, torch.Size], mine: dict[str, torch.Size],
                 folder: Path) -> None:
    """Refuse a checkpoint of another model, as DeepSpeed's load_state_dict does."""
    bad = [f"{n}: checkpoint {list(s)}, this model {list(mine[n])}"
           for n, s in saved.items() if n in mine and torch.Size(s) != mine[n]]
    if bad:
        raise CheckpointError(f"size mismatch loading the DeepSpeed checkpoint in '{folder}' "
                              f"({'; '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}): it "
                              "was saved from another model; load it into the model that "
                              "saved it")


def rank_files(folder: Path, world: int) -> list[Path]:
    """The ZeRO optimizer files, one per rank 0..world-1 of the run that saved them;
    missing or extra rank files are refused by name."""
    files: dict[int, Path] = {}
    for f in folder.glob("*zero_pp_rank_*_optim_states.pt"):
        try:
            files[int(f.name.split("zero_pp_rank_")[1].split("_")[0])] = f
        except ValueError:
            raise CheckpointError(f"'{f}' is not a DeepSpeed optimizer file name "
                                  "(zero_pp_rank_<r>_mp_rank_00_optim_states.pt)") from None
    if not files or world <= 0:
        return [files[r] for r in sorted(files)]
    want = set(range(world))
    if set(files) != want:
        missing = sorted(want - set(files))
        extra = sorted(set(files) - want)
        what = "; ".join(
            ([f"missing: rank(s) {', '.join(map(str, missing))}"] if missing else [])
            + ([f"extra: {', '.join(files[r].name for r in extra)}"] if extra else []))
        raise CheckpointError(f"'{folder}' was saved by {world} data-parallel ranks "
                              f"(dp_world_size) but holds optimizer files of ranks "
                              f"{sorted(files)} ({what}): copy the folder whole")
    return [files[r] for r in range(world)]


def _optimizer_state(path: Path) -> dict:
    data = read(path)
    if not isinstance(data, dict) or not isinstance(data.get("optimizer_state_dict"), dict):
        raise CheckpointError(f"'{path}' is not a DeepSpeed optimizer-states file (a dict "
                              "with 'optimizer_state_dict')")
    return data["optimizer_state_dict"]


class DeepSpeedShards:
    """A DeepSpeed checkpoint as whole per-parameter tensors, behind the interface
    `checkpoint.state.resliced` reads (`reader`, `state_names`, `scalars`, `buffers`)."""

    def __init__(self, folder: Path, names: list[list[str]],
                 shapes: dict[str, torch.Size] | None = None):
        """`names`: this engine's parameter names per user group, in the order the
        script gave them (DeepSpeed's optimizer order); `shapes`: its parameters' shapes,
        which the saved ones must equal (DeepSpeed's own load refuses a size mismatch)."""
        self.folder = folder
        path = next(folder / f for f in MODEL_FILES if (folder / f).is_file())
        self.model = read(path)
        if not isinstance(self.model, dict) or not isinstance(self.model.get("module"), dict):
            raise CheckpointError(f"'{path}' is not a DeepSpeed model-states file (a dict "
                                  "with the module's tensors under 'module')")
        self.full: dict[str, dict[str, Tensor]] = {}
        self.scalars: dict[tuple[str, str], Any] = {}
        self.groups: list[dict[str, Any]] = []
        if shapes is not None:
            check_shapes(self.saved_shapes(), shapes, folder)
        files = rank_files(folder, int(self.model.get("dp_world_size") or 0))
        if not files:
            self._stage0(names)
        else:
            self._zero(files, names)

    def _zero(self, files: list[Path], names: list[list[str]]) -> None:
        """ZeRO-1/2/3: the rank files, all of one run, put back together per parameter."""
        states = [_optimizer_state(f) for f in files]
        stages = [int(s.get("zero_stage", 0)) for s in states]
        if len(set(stages)) != 1:
            raise CheckpointError(
                f"the optimizer files in '{self.folder}' come from different runs: ZeRO "
                f"stages {', '.join(f'{f.name} {s}' for f, s in zip(files, stages, strict=True))}")
        try:
            if stages[0] == 3:
                self._stage3(states, names)
            else:
                self._stage12(states, names)
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"the optimizer files in '{self.folder}' are not laid out as DeepSpeed 0.19 "
                f"writes ZeRO-{stages[0]} ones ({type(e).__name__}: {e}); the folder may mix "
                "files of different runs") from None
        self._check_assembled(files)

    def saved_shapes(self) -> dict[str, torch.Size]:
        """Each saved parameter's shape: DeepSpeed's `param_shapes` (stages 1-3), else
        the module's tensors (stage 0)."""
        groups = self.model.get("param_shapes")
        if groups:
            return {n: torch.Size(s) for g in groups for n, s in g.items()}
        buffers = set(self.model.get("buffer_names") or [])
        return {n: t.shape for n, t in self.model["module"].items()
                if isinstance(t, Tensor) and n not in buffers}

    def _check_assembled(self, files: list[Path]) -> None:
        """Every parameter put back together from the rank files holds exactly its saved
        shape's elements: a rank file of another run or model does not fit."""
        shapes = self.saved_shapes()
        for kind, table in self.full.items():
            for name, t in table.items():
                want = math.prod(shapes.get(name, t.shape))
                if t.numel() != want:
                    raise CheckpointError(
                        f"the optimizer files in '{self.folder}' do not fit its model file: "
                        f"parameter '{name}' ({kind}) assembles to {t.numel()} elements, its "
                        f"saved shape {list(shapes[name])} holds {want}; the folder mixes "
                        f"files of different runs ({', '.join(f.name for f in files)})")

    def _check_flats(self, gi: int, per_kind: list[list[Tensor]], need: int) -> None:
        """ZeRO-3: every rank's flat piece of group `gi` has one size, enough for the
        saved shapes (a rank file of another model has another size)."""
        sizes = {t.numel() for ts in per_kind for t in ts}
        if len(sizes) != 1 or min(sizes) < need:
            raise CheckpointError(
                f"the optimizer files in '{self.folder}' do not fit its model file: group "
                f"{gi}'s per-rank pieces hold {sorted(sizes)} elements where the saved shapes "
                f"need {need} on each rank; the folder mixes files of different runs")

    # ---------------------------------------------------------------- layouts
    def _check_groups(self, n: int, names: list[list[str]]) -> None:
        if n != len(names):
            raise CheckpointError(f"the DeepSpeed checkpoint has {n} optimizer group(s), this "
                                  f"engine {len(names)}: pass model_parameters as the run that "
                                  "saved it did")

    def _put(self, kind: str, name: str, value: Tensor) -> None:
        self.full.setdefault(kind, {})[name] = value.detach().float().reshape(-1)

    def _stage0(self, names: list[list[str]]) -> None:
        """No ZeRO: the module holds the weights, a torch optimizer state_dict the rest."""
        module = self.model["module"]
        opt = self.model.get("optimizer") or {}
        self._check_groups(len(opt.get("param_groups", names)), names)
        order = [n for g in names for n in g]
        for n in order:
            self._put("master", n, module[n])
        # DeepSpeed's FusedAdam on the CPU saves step 0 beside moments that have seen
        # every update: the updates applied are the engine's steps less the skipped ones
        applied = self.global_steps - int(self.model.get("skipped_steps", 0))
        for idx, st in (opt.get("state") or {}).items():
            name = order[int(idx)]
            for k, v in st.items():
                if k == "step":
                    self.scalars[("step", name)] = float(v) or float(applied)
                elif isinstance(v, Tensor):
                    self._put(k, name, v)
        self.groups = opt.get("param_groups", [])

    def _stage12(self, states: list[dict], names: list[list[str]]) -> None:
        """ZeRO-1/2: each rank holds one flat fp32 partition per group; its
        `param_slice_mappings` say which piece of which parameter lies where in it, and a
        parameter's pieces, rank after rank, make it whole."""
        self._check_groups(len(states[0]["single_partition_of_fp32_groups"]), names)
        base = [s["base_optimizer_state"] for s in states]
        for gi in range(len(names)):
            pieces: dict[str, dict[str, list[Tensor]]] = {}
            for s, b in zip(states, base, strict=True):
                st = b["state"].get(gi, {})
                flats = {"master": s["single_partition_of_fp32_groups"][gi],
                         **{k: v for k, v in st.items() if isinstance(v, Tensor) and k != "step"}}
                for name, where in s["param_slice_mappings"][gi].items():
                    a, n = int(where.start), int(where.numel)
                    for kind, flat in flats.items():
                        pieces.setdefault(name, {}).setdefault(kind, []).append(flat[a:a + n])
            step = base[0]["state"].get(gi, {}).get("step")
            for name, kinds in pieces.items():
                for kind, parts in kinds.items():
                    self._put(kind, name, torch.cat(parts))
                if step is not None:
                    self.scalars[("step", name)] = float(step)
        self.groups = base[0].get("param_groups", [])

    def _stage3(self, states: list[dict], names: list[list[str]]) -> None:
        """ZeRO-3: each parameter padded to a multiple of the world size and cut in equal
        pieces; rank r's flat group holds its piece of every parameter, in order."""
        shapes = self.model.get("param_shapes") or []
        self._check_groups(len(shapes), names)
        world = len(states)
        base = [s["optimizer_state_dict"] for s in states]
        for gi, group_shapes in enumerate(shapes):
            flats = [s["fp32_flat_groups"][gi] for s in states]
            kinds = {k: [b["state"][gi][k] for b in base] for k in base[0]["state"][gi]
                     if isinstance(base[0]["state"][gi][k], Tensor) and k != "step"}
            step = base[0]["state"][gi].get("step")
            self._check_flats(gi, [flats, *kinds.values()],
                              sum(math.ceil(math.prod(s) / world) for s in group_shapes.values()))
            off = 0
            for name, shape in group_shapes.items():
                n = math.prod(shape)
                part = math.ceil(n / world)

                def whole(pieces: list[Tensor], off: int = off, part: int = part,
                          n: int = n) -> Tensor:
                    return torch.cat([p.reshape(-1)[off:off + part] for p in pieces])[:n]
                self._put("master", name, whole(flats))
                for k, ts in kinds.items():
                    self._put(k, name, whole(ts))
                if step is not None:
                    self.scalars[("step", name)] = float(step)
                off += part
        self.groups = base[0].get("param_groups", [])

    # ---------------------------------------------------------------- resliced's interface
    def reader(self, kind: str) -> Callable[[str, int, int], Tensor]:
        table = self.full.get(kind, {})

        def read_range(name: str, a: int, b: int) -> Tensor:
            if name not in table:
                raise CheckpointError(f"the DeepSpeed checkpoint in '{self.folder}' has no "
                                      f"{kind} for parameter '{name}'")
            return table[name][a:b]
        return read_range

    def state_names(self, params: list[str]) -> list[str]:
        names = {k for k, t in self.full.items() if k != "master" and any(p in t for p in params)}
        return sorted(names | {k for (k, p) in self.scalars if p in params})

    def buffers(self) -> dict[str, Tensor]:
        module = self.model["module"]
        return {n: module[n] for n in self.model.get("buffer_names") or [] if n in module}

    # ---------------------------------------------------------------- the rest
    @property
    def global_steps(self) -> int:
        return int(self.model.get("global_steps", 0))

    def client_state(self) -> dict[str, Any]:
        return {k: v for k, v in self.model.items() if k not in _DS_KEYS}
