"""Sharded, atomic checkpoints that never unpickle code.

Layout of one checkpoint (a directory):

    <root>/step_00000100/
        meta.json                  config, step, layout of every flat unit, scaler state
        rank00000.safetensors      this rank's master-weight shards + optimizer-state shards
        rank00000.json             optimizer hyper-parameters, segment table, scalar state
    <root>/latest                  name of the newest complete checkpoint

Atomicity: every rank writes into `step_X.tmp/`; after a barrier rank 0 renames the
directory and then replaces `latest` (write temp + os.replace). A run killed at any
moment leaves `latest` naming a complete checkpoint. Loading reads only safetensors and
JSON, so a checkpoint cannot execute code.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from zerotrain.comm.dist import barrier

FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, or incompatible with the config."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from a root (follows `latest`) or a step directory."""
    p = Path(path).expanduser()
    if (p / "meta.json").is_file():
        return p
    if (p / "latest").is_file():
        q = p / (p / "latest").read_text().strip()
        if (q / "meta.json").is_file():
            return q
        raise CheckpointError(f"'{p}/latest' names '{q.name}', which is incomplete or missing")
    if p.is_dir():
        raise CheckpointError(f"'{p}' holds no checkpoint (no meta.json and no 'latest' file); "
                              "pass the checkpoint root or one of its step_* folders")
    raise CheckpointError(f"checkpoint '{p}' does not exist")


def read_meta(ckpt: Path) -> dict[str, Any]:
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read '{ckpt / 'meta.json'}': {e}") from None
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"'{ckpt}' has checkpoint format {meta.get('format')}, this "
                              f"zerotrain reads format {FORMAT_VERSION}")
    return meta


def rank_files(ckpt: Path, rank: int) -> tuple[Path, Path]:
    return ckpt / f"rank{rank:05d}.safetensors", ckpt / f"rank{rank:05d}.json"


def read_rank(ckpt: Path, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    st, js = rank_files(ckpt, rank)
    if not st.is_file() or not js.is_file():
        raise CheckpointError(f"'{ckpt}' lacks the files of rank {rank} ({st.name}); the "
                              "checkpoint is incomplete")
    return load_file(st), json.loads(js.read_text())


def save_sharded(root: str | Path, step: int, rank: int, world: int,
                 tensors: dict[str, torch.Tensor], rank_meta: dict[str, Any],
                 meta: dict[str, Any], keep: int) -> Path:
    """Collective: every rank calls it with its own shards; rank 0 also writes meta."""
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / (final.name + ".tmp")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    st, js = rank_files(tmp, rank)
    # safetensors refuses views that share storage; checkpoint time can afford a copy.
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(st))
    js.write_text(json.dumps(rank_meta))
    barrier()
    if rank == 0:
        meta = dict(meta, format=FORMAT_VERSION, step=step, world_size=world)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if final.exists():  # re-saving the same step: move the old one aside first
            old = root / (final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _atomic_write_text(root / "latest", final.name)
        _prune(root, keep)
    barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(
        (".tmp", ".old")))
    for p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob("step_*.tmp"):  # leftovers of a save that was killed
        shutil.rmtree(p, ignore_errors=True)
