"""The run folder's rules: one run per folder, and what `--resume` means in it.

- A new run refuses a folder that holds another run (its checkpoints or metrics), unless
  told to resume it or to overwrite it (`logging.overwrite`), so nothing is lost by a
  second `zerotrain train` with the same `logging.run_dir`.
- `--resume` takes the folder's latest checkpoint (or a given path); `--resume auto`
  resumes when a complete checkpoint exists and starts afresh otherwise — what a
  preemptible job script runs every time, and what restarted ranks do.
- A checkpoint that does not load is named, with the newest older one that really loads
  into this run (same model, compatible optimizer, files intact), or, for another model,
  the settings that differ.

These checks need no model, so the launcher runs them before any rank starts.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from zerotrain.checkpoint import CheckpointError, resolve
from zerotrain.checkpoint.io import complete_checkpoints, read_meta, verify
from zerotrain.config import Config, ConfigError

#: what a training run leaves in its folder (removed by logging.overwrite)
RUN_FILES = ("metrics.jsonl", "config.json", "curves.png", "sample.txt")
RUN_DIRS = ("tensorboard", "wandb")


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.logging.run_dir) / \
        "checkpoints"


def check_writable(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"logging.run_dir '{run_dir}' is a file; give a folder path")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"logging.run_dir '{run_dir}' is not writable ({e.strerror}); "
                          "give another --logging.run_dir") from None


def holds_run(cfg: Config) -> str | None:
    """What shows that the run folder already holds a run, or None."""
    run_dir, root = Path(cfg.logging.run_dir), checkpoint_root(cfg)
    if root.is_dir():
        done = complete_checkpoints(root)
        if done:
            return f"checkpoint {done[-1].name}"
    if (run_dir / "metrics.jsonl").is_file():
        return "metrics.jsonl"
    return None


def resolve_resume(cfg: Config, resume: str | None) -> Path | None:
    """The checkpoint to resume from (None: start afresh); raises on a folder conflict.

    `resume`: None (a new run), "" or "latest" (the folder's latest), "auto", or a path.
    """
    run_dir, root = Path(cfg.logging.run_dir), checkpoint_root(cfg)
    check_writable(run_dir)
    if resume == "auto":
        return root if root.is_dir() and complete_checkpoints(root) else None
    if resume is not None:
        src = root if resume in ("", "latest") else Path(resume)
        try:
            resolve(src)
        except CheckpointError as e:
            raise CheckpointError(f"--resume: {e}") from None
        return src
    found = holds_run(cfg)
    if found and not cfg.logging.overwrite:
        # name the setting whose folder holds it: a shared checkpoint.dir, or the run folder
        setting, where = (("checkpoint.dir", root) if cfg.checkpoint.dir is not None
                          and found.startswith("checkpoint ") else ("logging.run_dir", run_dir))
        raise ConfigError(
            f"{setting} '{where}' holds another run ({found}); continue it with "
            f"--resume, start elsewhere with a new --{setting}, or replace it with "
            "--logging.overwrite true")
    return None


def clear_run(cfg: Config) -> None:
    """Remove a previous run's files (a new run starting in its folder; rank 0)."""
    run_dir, root = Path(cfg.logging.run_dir), checkpoint_root(cfg)
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for f in run_dir.glob("metrics-*.csv"):
        f.unlink()
    for name in RUN_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    if root.is_dir():
        for p in [*root.glob("step_*"), root / "latest"]:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


#: settings that decide a checkpoint's tensor names and shapes (what `check_model` holds
#: a resume to); a model mismatch names the ones that differ — the chosen ones when any
#: differ, else those that follow from them (a family's defaults, the tokenizer's size)
SHAPE_SETTINGS = ("model.arch", "model.preset", "model.hf", "model.n_layer", "model.n_head",
                  "model.n_kv_head", "model.n_embd", "model.block_size", "model.mlp_ratio",
                  "data.tokenizer")
DERIVED_SHAPE_SETTINGS = ("model.intermediate_size", "model.vocab_size", "model.bias",
                          "model.tie_weights")


class RunFit:
    """Whether a checkpoint (its meta.json) can load into this run: the same tensors
    (names, shapes) and a compatible optimizer — the checks a resume makes before it
    reads a tensor. No collectives, no tensor reads."""

    def __init__(self, layout: dict[str, Any], optimizer: str, reset_optimizer: bool,
                 config: dict[str, Any]):
        self.layout, self.optimizer, self.reset = layout, optimizer, reset_optimizer
        self.config = config

    def check(self, meta: dict[str, Any]) -> None:
        """Raises CheckpointError when the checkpoint does not fit this run."""
        from zerotrain.checkpoint.state import check_model, check_optimizer

        check_model(meta["layout"], self.layout)
        check_optimizer(meta, self.optimizer, self.reset)

    def shape_differences(self, meta: dict[str, Any]) -> list[str]:
        """'model.n_embd 32 (this run: 64)' for each shape setting that differs. A
        checkpoint whose model was not built from its config's `model:` section (a
        `zerotrain.initialize` script's module, a converted DeepSpeed checkpoint) is
        described by its saved parameters instead: its `model:` values are defaults."""
        if not (meta.get("extra") or {}).get("built_from_config"):
            params = [f"{name} {list(shape)}" for u in meta.get("layout", {}).get("units", [])
                      for name, shape, *_ in u.get("params", [])]
            return [f"{NOT_FROM_CONFIG} (a script's module or a converted DeepSpeed "
                    f"checkpoint; its parameters: {', '.join(params[:3])}"
                    + (" ...)" if len(params) > 3 else ")")] if params else []
        saved = meta.get("config", {})

        def diff(keys: tuple[str, ...]) -> list[str]:
            out = []
            for key in keys:
                section, name = key.split(".")
                mine = saved.get(section, {})
                if name in mine and mine[name] != self.config.get(section, {}).get(name):
                    out.append(f"{key} {mine[name]} (this run: "
                               f"{self.config[section][name]})")
            return out

        return diff(SHAPE_SETTINGS) or diff(DERIVED_SHAPE_SETTINGS)


def fits_run(engine: Any, cfg: Config) -> RunFit:
    """This run's `RunFit`, from its engine (built, not yet loaded) and config."""
    return RunFit(engine.strategy.layout(), cfg.optimizer.name, cfg.checkpoint.reset_optimizer,
                  cfg.to_dict())


def loadable_fallback(src: Path, bad: Path | None, fit: RunFit | None = None) -> Path | None:
    """The newest complete checkpoint beside `src` other than `bad` whose files verify
    and (given `fit`) that fits this run — one that really does load."""
    root = src if (src / "latest").exists() or not (src / "meta.json").exists() else src.parent
    for ckpt in reversed(complete_checkpoints(root)):
        if bad is not None and ckpt.resolve() == bad.resolve():
            continue
        try:
            meta = read_meta(ckpt)
            if fit is not None:
                fit.check(meta)
            verify(ckpt, meta, [f for f in ckpt.iterdir() if f.name != "meta.json"])
        except (CheckpointError, KeyError, TypeError):
            continue
        return ckpt
    return None


NOT_FROM_CONFIG = "not built from a model: section"


def explain_failed_load(src: Path, error: CheckpointError,
                        fit: RunFit | None = None) -> CheckpointError:
    """The load error, plus the way out: an older checkpoint that does load into this
    run, if one does; for another model, the settings that differ."""
    try:
        bad = resolve(src)
    except CheckpointError:
        bad = None
    older = loadable_fallback(src, bad, fit)
    if older is not None:
        return CheckpointError(f"{error}; {older.name} still loads: resume from it with "
                               f"--resume {older}")
    hint = ""
    if fit is not None and bad is not None:
        try:
            diffs = fit.shape_differences(read_meta(bad))
        except (CheckpointError, AttributeError):
            diffs = []
        if diffs and diffs[0].startswith(NOT_FROM_CONFIG):
            hint = (f"; the checkpoint's model was {diffs[0]}: load it where that module "
                    "is built (zerotrain.deepspeed or zerotrain.initialize in the script), "
                    "or start a new run in another --logging.run_dir")
        elif diffs:
            hint = (f"; the checkpoint's model: {', '.join(diffs[:4])}: resume with its "
                    "settings, or start a new run in another --logging.run_dir")
    return CheckpointError(f"{error}{hint}")
