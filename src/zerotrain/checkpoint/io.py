"""Sharded, atomic, checksummed checkpoints that never unpickle code.

Layout of one checkpoint (a directory):

    <root>/step_00000100/
        meta.json                  manifest: config, step, layout, counters, checksums
        rank00000.safetensors      this rank's tensors (master shards, optimizer state, RNG)
        rank00000.json             this rank's cut of the layout, optimizer groups, scalars
    <root>/latest                  name of the newest complete checkpoint

Atomicity: every rank writes into `step_X.tmp/`; after a barrier rank 0 records every
file's SHA-256 in `meta.json`, renames the directory, then replaces `latest` (write temp
+ os.replace). A run killed at any moment leaves `latest` naming a complete checkpoint.
Loading verifies the checksum of every file it reads and reads only safetensors and JSON,
so a damaged checkpoint is named instead of loaded, and none can execute code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from zerotrain.checkpoint import stream
from zerotrain.comm.dist import patient_barrier
from zerotrain.zero.tiers.lazy import Lazy

FORMAT_VERSION = 2
#: Formats no zerotrain writes any more, with how to get on from one. Format 1 (before
#: 2026-11-30, commit 58939c5: no checksums, master weights under other names, optimizer
#: tensors in their parameter's shape) is read by no code here.
RETIRED_FORMATS = {1: "export its weights with a zerotrain from before 2026-11-30 "
                      "(`zerotrain export {ckpt} --out weights.safetensors`) and start from "
                      "them with --model.init_from weights.safetensors (the optimizer state "
                      "starts afresh)"}


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, damaged or incompatible."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from a root (follows `latest`), a step directory, or a run
    folder whose `checkpoints/` holds them."""
    p = Path(path).expanduser()
    if (p / "meta.json").is_file():
        return p
    if (p / "latest").is_file():
        q = p / read_latest(p)
        if (q / "meta.json").is_file():
            return q
        if any((q / f).is_file() for f in DEEPSPEED_MODEL_FILES):
            raise CheckpointError(
                f"'{p}' is a DeepSpeed checkpoint ('{q.name}' holds DeepSpeed's "
                f"{next(f for f in DEEPSPEED_MODEL_FILES if (q / f).is_file())}), not a "
                f"zerotrain one: convert it first with zerotrain convert --from-deepspeed {p} "
                "--out CKPT, then use CKPT")
        raise CheckpointError(f"'{p}/latest' names '{q.name}', which is incomplete or missing")
    if (p / "checkpoints").is_dir():
        return resolve(p / "checkpoints")
    if p.is_dir():
        raise CheckpointError(f"'{p}' holds no checkpoint (no meta.json and no 'latest' file); "
                              "pass the checkpoint root or one of its step_* folders")
    raise CheckpointError(f"checkpoint '{p}' does not exist")


#: the model-states files of a DeepSpeed checkpoint folder (stages 0-2, stage 3)
DEEPSPEED_MODEL_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def latest_name(root: Path) -> str | None:
    """The step folder name in `root/latest`, or None when there is no such file or it
    names no step folder (not UTF-8, empty, a path, a NUL)."""
    try:
        name = (root / "latest").read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        return None
    return name


def read_latest(root: Path) -> str:
    """The step folder name in `root/latest`; a damaged file (not UTF-8, a path, a NUL)
    is one CheckpointError naming the checkpoints that remain."""
    name = latest_name(root)
    if name is None:
        raw = (root / "latest").read_bytes()
        done = [c.name for c in complete_checkpoints(root)]
        have = (f"complete checkpoints: {', '.join(done[-3:])}; resume one with --resume "
                f"{root / done[-1]}" if done else "no complete checkpoint is left")
        raise CheckpointError(f"'{root}/latest' is damaged (it names no step folder: "
                              f"{raw[:40]!r}); {have}")
    return name


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete step folders under a root, oldest first by their recorded save order."""
    done = [p for p in root.glob("step_*") if (p / "meta.json").is_file()
            and not p.name.endswith((".tmp", ".old"))]
    return sorted(done, key=lambda p: (_saved_at(p), p.name))


def _saved_at(ckpt: Path) -> float:
    try:
        return float(json.loads((ckpt / "meta.json").read_text()).get("saved_at", 0.0))
    except (OSError, ValueError, AttributeError):
        return 0.0


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read '{path}': {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"'{path}' is damaged: expected a JSON object")
    return data


def read_meta(ckpt: Path) -> dict[str, Any]:
    meta = read_json(ckpt / "meta.json")
    fmt = meta.get("format")
    if fmt in RETIRED_FORMATS:
        raise CheckpointError(f"'{ckpt}' has checkpoint format {fmt}, which this zerotrain "
                              f"no longer reads; {RETIRED_FORMATS[fmt].format(ckpt=ckpt)}")
    if fmt != FORMAT_VERSION:
        raise CheckpointError(f"'{ckpt}' has checkpoint format {fmt}, this zerotrain reads "
                              f"format {FORMAT_VERSION}")
    missing = [k for k in ("layout", "global_step", "micro_step", "scaler", "world_size",
                           "checksums") if k not in meta]
    if missing:
        raise CheckpointError(f"'{ckpt / 'meta.json'}' is damaged: it lacks {', '.join(missing)}")
    return meta


def rank_files(ckpt: Path, rank: int) -> tuple[Path, Path]:
    return ckpt / f"rank{rank:05d}.safetensors", ckpt / f"rank{rank:05d}.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(ckpt: Path, meta: dict[str, Any], files: list[Path]) -> None:
    """Compare files against the manifest's checksums."""
    sums = meta["checksums"]
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"'{f}' is missing: the checkpoint is incomplete")
        want = sums.get(f.name)
        if want is None or sha256(f) != want:
            raise CheckpointError(f"'{f}' is damaged (its checksum does not match the "
                                  "manifest)")


def _write_rank(tmp: Path, rank: int, tensors: dict[str, Any],
                rank_meta: dict[str, Any]) -> None:
    """This rank's files. The tensors are written one at a time (`stream.write`: the
    bytes `save_file` writes), each brought to the host — or in from its offload tier, a
    `Lazy` one — just before its bytes go out and dropped after: no copy of the whole
    state is ever made."""
    st, js = rank_files(tmp, rank)
    if stream.writable(tensors):
        digest = stream.write(st, tensors)
    else:  # a dtype the writer does not order: safetensors itself, from host copies
        host = {k: (v.load() if isinstance(v, Lazy) else v).detach().to("cpu", copy=True)
                .contiguous() for k, v in tensors.items()}
        save_file(host, str(st))
        digest = sha256(st)
    js.write_text(json.dumps(dict(rank_meta, sha256=digest)))


def save_sharded(root: str | Path, step: int, rank: int, world: int,
                 tensors: dict[str, Any], rank_meta: dict[str, Any],
                 meta: dict[str, Any], keep: int, name: str | None = None,
                 latest: bool = True) -> Path:
    """Collective: every rank calls it with its own shards; rank 0 also writes meta."""
    root = Path(root)
    final = root / (name or step_dir_name(step))
    tmp = root / (final.name + ".tmp")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    # store-based barriers: rank 0's folder work and each rank's write (lazy NVMe-tier
    # states read back, a shared filesystem) may outlast comm.timeout_s (NCCL: abort)
    patient_barrier()
    _write_rank(tmp, rank, tensors, rank_meta)
    patient_barrier()
    if rank == 0:
        _finish(root, tmp, final, world, dict(meta, step=step), keep, latest)
    patient_barrier()  # rank 0's solo finishing may outlast comm.timeout_s (NCCL: abort)
    return final


def _finish(root: Path, tmp: Path, final: Path, world: int, meta: dict[str, Any],
            keep: int, latest: bool = True) -> None:
    import time

    sums = {}
    for r in range(world):
        st, js = rank_files(tmp, r)
        sums[st.name] = read_json(js)["sha256"]
        sums[js.name] = sha256(js)
    meta = dict(meta, format=FORMAT_VERSION, world_size=world, checksums=sums,
                saved_at=time.time())
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    mode = _file_mode()
    for f in tmp.iterdir():  # one permission for every file, whatever wrote it
        f.chmod(mode)
    if final.exists():  # re-saving the same step: move the old one aside first
        old = root / (final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    if latest:
        _atomic_write_text(root / "latest", final.name)
    prune(root, keep, run_id=meta.get("run_id"))


def _file_mode() -> int:
    """The mode a plain `open()` gives a new file under the current umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def prune(root: Path, keep: int, run_id: str | None = None) -> None:
    """Keep this run's `keep` most recent checkpoints; never touch another run's."""
    mine = [p for p in complete_checkpoints(root)
            if run_id is None or read_json(p / "meta.json").get("run_id") == run_id]
    latest = latest_name(root)
    for p in mine[:-keep]:
        if p.name != latest:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.glob("step_*.tmp"):  # leftovers of a save that was killed
        shutil.rmtree(p, ignore_errors=True)
