"""`zerotrain convert --from-deepspeed`: a DeepSpeed checkpoint written as a zerotrain one,
without the model's code (a stand-in module of the saved names and shapes). Apart from
the reader (`checkpoint.py`) because it builds an engine through `initialize`."""

from __future__ import annotations

from pathlib import Path

import torch

from zerotrain.checkpoint.io import CheckpointError
from zerotrain.deepspeed import initialize
from zerotrain.deepspeed.checkpoint import MODEL_FILES, DeepSpeedShards, find, read, tags_in


class _Holder(torch.nn.Module):
    """A module tree with parameters at the given dotted names and nothing else."""


def stand_in_model(shapes: dict[str, torch.Size]) -> torch.nn.Module:
    """A model with exactly these parameter names and shapes (zeros until loaded), for a
    checkpoint converted without the model's code."""
    root = _Holder()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, _Holder())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape)))
    return root


def convert(folder_or_root: str | Path, out: str | Path, tag: str | None = None) -> Path:
    """Write a DeepSpeed checkpoint as a zerotrain checkpoint (one rank, ZeRO-0 layout;
    it loads at any world size and stage): weights, optimizer state, step, scheduler."""
    folder = find(folder_or_root, tag)
    if folder is None:
        tags = tags_in(Path(folder_or_root))
        if tag is not None and tags:
            raise CheckpointError(f"'{folder_or_root}' has no DeepSpeed checkpoint tagged "
                                  f"'{tag}'; its tags: {', '.join(tags)}")
        raise CheckpointError(f"'{folder_or_root}' holds no DeepSpeed checkpoint (no 'latest' "
                              "naming a folder with mp_rank_00_model_states.pt"
                              + (f"; its tags: {', '.join(tags)}: pass one with --tag"
                                 if tags else "") + ")")
    path = next(folder / f for f in MODEL_FILES if (folder / f).is_file())
    model = read(path)
    if not isinstance(model, dict) or not isinstance(model.get("module"), dict):
        raise CheckpointError(f"'{path}' is not a DeepSpeed model-states file (a dict with the "
                              f"module's tensors under 'module'; it holds a "
                              f"{type(model).__name__})")
    ds = model.get("ds_config") or {}
    if "optimizer" not in ds:
        raise CheckpointError("the run's DeepSpeed config names no optimizer (it used a client "
                              "optimizer): load the folder with engine.load_checkpoint in the "
                              "script instead, which knows the optimizer")
    shapes = model.get("param_shapes")
    if shapes:
        groups = [dict(g) for g in shapes]
    else:  # ZeRO-0 saves no shapes: the module's parameters, one group
        opt = model.get("optimizer") or {}
        if len(opt.get("param_groups", [1])) != 1:
            raise CheckpointError("a ZeRO-0 checkpoint with several param groups does not "
                                  "say which parameter is in which: load it with "
                                  "engine.load_checkpoint in the script instead")
        buffers = set(model.get("buffer_names") or [])
        groups = [{n: t.shape for n, t in model["module"].items() if n not in buffers}]
    net = stand_in_model({n: torch.Size(s) for g in groups for n, s in g.items()})
    named = dict(net.named_parameters())
    # each group's own settings (weight decay, lr, betas, ...) as the run's optimizer kept them
    saved = DeepSpeedShards(folder, [list(g) for g in groups]).groups
    settings = [{k: v for k, v in h.items() if k not in ("params", "step")} for h in saved]
    # one rank, no ZeRO: the batch of the original world size does not apply here
    ds = {**{k: v for k, v in ds.items() if k != "train_batch_size"},
          "zero_optimization": {"stage": 0},
          "train_micro_batch_size_per_gpu": ds.get("train_micro_batch_size_per_gpu") or 1,
          "gradient_accumulation_steps": ds.get("gradient_accumulation_steps") or 1}
    engine, _, _, _ = initialize(model=net, config=ds, model_parameters=[
        {**(settings[i] if i < len(settings) else {}), "params": [named[n] for n in g]}
        for i, g in enumerate(groups)])
    _, client = engine.load_checkpoint(folder)
    engine.save_checkpoint(out, tag=folder.name, client_state=client)
    engine.close()
    return Path(out) / folder.name
