"""Building a training run: config -> data -> engine, resumed or fresh, in its folder.

`setup` makes the `Run` that the loop (`loop.py`) steps: the process group, the data
(`load_data`: tokenizer, token shards, windows, validation batches), the model and engine
(`build`), the checkpoint to resume from (`run_dir.py`'s rules) and the `Reporter`. The
launcher runs the checks that need no model (`check_before_launch`) once, before any
rank starts. Every rank runs this same code; only rank 0 reports.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerotrain.checkpoint import CheckpointError
from zerotrain.checkpoint.io import complete_checkpoints
from zerotrain.comm.dist import (
    DistInfo,
    init_distributed,
    patient_barrier,
    pick_device,
)
from zerotrain.config import Config, ConfigError, DataConfig, check_sequence_parallel
from zerotrain.config.nodes import check_nodes
from zerotrain.config.training import DEFAULT_WARMUP
from zerotrain.data.dataset import (
    cached_shards,
    clear_caches,
    describe,
    load_splits,
    needs_shards,
    resolve_tokenizer,
)
from zerotrain.data.errors import DataError
from zerotrain.data.sampler import WindowSampler, eval_batches
from zerotrain.data.tokenizer import Tokenizer, token_byte_lengths
from zerotrain.engine import Engine
from zerotrain.models import (
    build_model,
    check_weights,
    pretrained_weights,
    resolve_model_config,
)
from zerotrain.models.hf import has_weights as hf_has_weights
from zerotrain.run.lifecycle import disk_full, disk_full_error, restart_count, tensor_bytes
from zerotrain.run.report import Reporter
from zerotrain.run.run_dir import (
    checkpoint_root,
    clear_run,
    explain_failed_load,
    fits_run,
    new_run_id,
    resolve_resume,
)


class Diverged(RuntimeError):
    """Training produced non-finite values; the message says what to change."""


def _threads(cfg: Config) -> int:
    if cfg.train.threads:
        return cfg.train.threads
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, (os.cpu_count() or 1) // local)


Batches = list[tuple[torch.Tensor, torch.Tensor]]


def val_bytes_per_token(engine: Engine, batches: Batches, tok: Tokenizer) -> float:
    """Text bytes per target token of the validation set (for bits per byte); with
    data.document_mask, of the scored targets (none predicted at an EOS)."""
    lengths = torch.from_numpy(token_byte_lengths(tok).astype("float64"))
    eos = engine.docs.eos if engine.docs is not None else None
    scored = [y[x != eos] if eos is not None else y for x, y in batches]
    local = [sum(float(lengths[y].sum()) for y in scored),
             float(sum(y.numel() for y in scored))]
    total = engine.comm.all_reduce_scalars(local)
    return float(total[0] / total[1])


@dataclass
class Run:
    """Everything one training run holds, built once by `setup`."""

    cfg: Config
    dist: DistInfo
    engine: Engine
    sampler: WindowSampler
    val_set: list[tuple[torch.Tensor, torch.Tensor]]
    run_dir: Path
    ckpt_root: Path
    report: Reporter
    resumed: bool
    tokenizer: Tokenizer

    val_bpt: float = 1.0  # text bytes per validation target token
    last_loss: torch.Tensor | None = None  # the latest step's mean loss (on the device)

    @property
    def global_tokens(self) -> int:
        c = self.cfg
        dp = self.dist.world_size // c.sequence.parallel  # SP groups share sequences
        return (c.data.micro_batch_size * dp * c.data.grad_accum_steps
                * c.model.block_size)

    def save(self, val_loss: float | None = None, loss_ok: bool | None = None) -> Path:
        """A checkpoint of the current step — never of non-finite weights, nor of finite
        ones whose loss is not (`val_loss` when given, else the latest step's; `loss_ok`
        when the caller has checked): a run that diverged within its last
        train.max_skipped_steps steps ends here, not with a NaN-producing checkpoint."""
        eng = self.engine
        if not eng.strategy.weights_finite():
            raise Diverged(f"the weights are not finite at step {eng.global_step}; not "
                           f"saving them. {self._causes()} and {self._earlier()}")
        if val_loss is not None:
            loss_ok = math.isfinite(val_loss)
        elif loss_ok is None:
            loss_ok = self.loss_finite()
        if not loss_ok:
            what = ("the training loss is not finite" if val_loss is None
                    else f"the validation loss is {val_loss}")
            raise Diverged(f"training diverged: {what} at step {eng.global_step}, so these "
                           f"weights were not saved. {self._causes()} and {self._earlier()}")
        try:
            return eng.save_checkpoint(self.ckpt_root)
        except Exception as e:  # safetensors' SafetensorError is no OSError
            if not disk_full(e):
                raise
            raise disk_full_error(e, self.ckpt_root, eng.global_step,
                                  tensor_bytes(eng.state_dict(lazy=True))) from None

    def loss_finite(self) -> bool:
        """Whether the latest step's loss was finite on every rank (the same answer on
        all of them: they save together or not at all)."""
        if self.last_loss is None:
            return True
        flag = float(not bool(torch.isfinite(self.last_loss)))
        if self.dist.world_size > 1:
            flag = float(self.engine.comm.all_reduce_scalars([flag], op="max")[0])
        return flag == 0

    def _causes(self) -> str:
        """What to change: the learning rate — or, with states in ZeRO-Infinity's swap
        files, those files, which nothing checks (a process or a failing disk that
        changes them under the run shows up as non-finite weights the next step)."""
        tiers = self.engine.strategy.moving_tiers()
        files = [str(f) for t in tiers if (f := getattr(t, "file", None)) is not None]
        lr = "Lower optimizer.lr (or use precision.dtype bf16)"
        if not files:
            return lr
        return (f"If the loss was steady before, suspect the offload swap file rather than "
                f"the learning rate: this rank's {', '.join(files)} (zero.nvme_path; its "
                f"contents are not checksummed) may have been changed or damaged under the "
                f"run — check the disk; else {lr[0].lower()}{lr[1:]}")

    def _earlier(self) -> str:
        done = complete_checkpoints(self.ckpt_root) if self.ckpt_root.is_dir() else []
        if not done:
            return "train again (no earlier checkpoint was saved)"
        return f"resume from an earlier checkpoint ({done[-1]}) or train again"


@dataclass
class Data:
    cfg: Config              # with the model's sizes resolved (preset, tokenizer, model.hf)
    tokenizer: Tokenizer
    sampler: WindowSampler
    val_set: Batches
    summary: str = ""         # one line: files, bytes, tokens (rank 0)
    notes: list[str] = field(default_factory=list)  # caches dropped or rebuilt (rank 0)


#: set by the launcher once it has dropped the run folder's caches for
#: --logging.overwrite, so that its ranks do not drop what it just rebuilt
CACHES_DROPPED = "ZEROTRAIN_CACHES_DROPPED"


def drops_caches(cfg: Config, src: Path | None) -> bool:
    """Whether this start replaces the folder's run (--logging.overwrite, nothing
    resumed) and must drop the data caches of the run it replaces."""
    here = str(Path(cfg.logging.run_dir).resolve())
    return src is None and cfg.logging.overwrite and os.environ.get(CACHES_DROPPED) != here


def load_data(cfg: Config, rank: int, world: int, drop_caches: bool = False) -> Data:
    """Tokenizer, training sampler and this rank's validation batches; data errors raise
    here. A `bpe:N` tokenizer and the token shards of text inputs are made once, by rank
    0, in the run folder, and reused by the other ranks and by resumed runs (the shards
    while the inputs' size and time stamps are unchanged); `drop_caches` (a run replacing
    the folder's) removes both first."""
    d, run_dir = cfg.data, Path(cfg.logging.run_dir)
    if d.path is not None and not Path(d.path).expanduser().exists():
        raise DataError(f"data.path '{d.path}' does not exist; pass a text file, a folder, "
                        ".jsonl/.parquet, token shards or a .bin from `zerotrain prepare`")
    tok, path, notes = None, d.path, []
    for turn in (0, 1):  # rank 0 makes what is missing, then the others read it
        if (rank == 0) == (turn == 0):
            if drop_caches and rank == 0:
                notes += [f"[zerotrain] --logging.overwrite: removed {p}"
                          for p in clear_caches(run_dir, d.path, d.tokenizer)]
            tok = resolve_tokenizer(d.tokenizer, d.path, run_dir, d.text_field)
            if needs_shards(d.path, tok):
                path = cached_shards(d.path, tok, run_dir, d.text_field, notes)
        patient_barrier()  # rank 0 may tokenize for longer than comm.timeout_s
    assert tok is not None
    if d.tokenizer.startswith("bpe:") and tok.vocab_size != int(d.tokenizer[4:]):
        notes.append(f"[zerotrain] data.tokenizer {d.tokenizer}: the corpus supplies only "
                     f"{tok.vocab_size:,} tokens (no more pairs recur); the model's "
                     "vocabulary follows the tokenizer")
    model_cfg = resolve_model_config(cfg.model, tokenizer_vocab=tok.vocab_size)
    cfg = cfg.model_copy(update={"model": model_cfg, "data": _document_eos(d, tok)})
    train_src, val_src = load_splits(path, tok, d.val_fraction, d.text_field)
    T = model_cfg.block_size
    sampler = WindowSampler(train_src, T, cfg.train.seed)
    sp = cfg.sequence.parallel  # one sequence-parallel group is one data-parallel rank
    val = eval_batches(val_src, T, rank // sp, world // sp, d.micro_batch_size,
                       cfg.logging.eval_batches)
    summary = (f"[zerotrain] data: {describe(path, tok)}; {sampler.n_windows:,} training "
               f"windows of {T + 1} tokens") if rank == 0 else ""
    return Data(cfg, tok, sampler, val, summary, notes if rank == 0 else [])


def _document_eos(d: DataConfig, tok: Tokenizer) -> DataConfig:
    """data.document_mask: the EOS id is data.eos_token_id, else the tokenizer's (the
    token the shards put between documents); one ConfigError when neither is known."""
    if not d.document_mask or d.eos_token_id is not None:
        return d
    if tok.eos_id is None:
        raise ConfigError(
            f"data.document_mask needs the token that ends a document, and the tokenizer "
            f"'{tok.name}' has none (the byte tokenizer separates documents by a blank "
            "line, not a token): use data.tokenizer bpe:N or a Hugging Face tokenizer, "
            "set data.eos_token_id, or set data.document_mask false")
    return d.model_copy(update={"eos_token_id": tok.eos_id})


def check_before_launch(cfg: Config, resume: str | None, world: int) -> None:
    """What the launcher checks before starting ranks: devices, run folder and data
    (made here once: the ranks then find the tokenizer and token shards ready)."""
    device = pick_device(cfg.train.device, 0, local_world=world)
    check_weights(cfg.model)
    from zerotrain.run.tier_check import check_nvme_path

    check_nvme_path(cfg, world, device.type)
    check_sequence_parallel(cfg.sequence.parallel, world, seq_len=cfg.model.block_size)
    check_nodes(cfg, world)
    src = resolve_resume(cfg, resume)
    data = load_data(cfg, 0, world, drop_caches=drops_caches(cfg, src))
    for line in data.notes:
        print(line, flush=True)


@contextmanager
def launch_checked(cfg: Config, resume: str | None, world: int) -> Iterator[None]:
    """`check_before_launch`, then launch the ranks inside: they learn (from the
    environment) that the caches a --logging.overwrite drops are already dropped."""
    check_before_launch(cfg, resume, world)
    if cfg.logging.overwrite:
        os.environ[CACHES_DROPPED] = str(Path(cfg.logging.run_dir).resolve())
    try:
        yield
    finally:
        os.environ.pop(CACHES_DROPPED, None)


def build(cfg: Config, device: torch.device) -> Engine:
    """The model of `model:`, built on the meta device and materialised by the engine unit
    by unit (no rank ever holds more than its stage requires), with its pretrained
    weights if it has any (each rank reads only the slices it keeps)."""
    random_hf = cfg.model.hf is not None and cfg.model.init_from is None and \
        not hf_has_weights(cfg.model.hf)
    model = build_model(cfg.model, device=None if random_hf else "meta")
    weights = pretrained_weights(cfg.model, model)
    engine = Engine(model, cfg, device, weights=weights.read_slice if weights else None)
    if weights is not None:
        weights.close()
    engine.extra_meta.update(built_from_config=True,
                             hf_config=getattr(model, "hf_config", None))
    return engine


def setup(cfg: Config, resume: str | None) -> Run:
    info = init_distributed(cfg.train.device, cfg.comm.backend, cfg.comm.timeout_s)
    torch.set_num_threads(_threads(cfg))
    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank
    if restart_count() > 0:  # restarted by the elastic agent: continue from the latest
        resume = "auto"
    src = resolve_resume(cfg, resume)  # the run folder's rules, before the model exists
    check_sequence_parallel(cfg.sequence.parallel, info.world_size,
                            seq_len=cfg.model.block_size)
    data = load_data(cfg, info.rank, info.world_size, drop_caches=drops_caches(cfg, src))
    cfg = data.cfg
    engine = build(cfg, info.device)
    engine.extra_meta["tokenizer"] = data.tokenizer.describe()
    engine.run_id = new_run_id()
    run_dir = Path(cfg.logging.run_dir)
    lines = _resume(engine, src, cfg) if src is not None else []
    patient_barrier()  # every rank has checked the folder before rank 0 may clear it
    if src is None and info.rank == 0:
        clear_run(cfg)  # what an earlier, unresumable attempt or --logging.overwrite left
    patient_barrier()  # rank 0's rmtree of old checkpoints may outlast comm.timeout_s
    report = Reporter(cfg, run_dir, info.rank, engine.global_step,
                      engine.global_step if src is not None else None)
    if src is None and resume == "auto":  # say so: the user may have expected a resume
        why = f"restart {restart_count()}" if restart_count() else "--resume auto"
        lines.append(f"[zerotrain] {why}: no complete checkpoint in {checkpoint_root(cfg)}; "
                     "starting a new run from step 0")
    note = cfg.optimizer.state_note()
    for line in [data.summary, *data.notes, *_default_notes(cfg), *lines, *([note] * bool(note))]:
        report.say(line)
    run = Run(cfg, info, engine, data.sampler, data.val_set, run_dir, checkpoint_root(cfg),
              report, src is not None, data.tokenizer)
    run.val_bpt = val_bytes_per_token(engine, data.val_set, data.tokenizer)
    if info.rank == 0:
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    return run


def _default_notes(cfg: Config) -> list[str]:
    """Defaults this run scaled to itself, said once so that nothing changes unseen."""
    s = cfg.schedule
    if "warmup_steps" not in s.model_fields_set and s.warmup_steps != DEFAULT_WARMUP:
        return [f"[zerotrain] schedule.warmup_steps not set: {s.warmup_steps} (a tenth of "
                f"this {cfg.train.steps}-step run; the default {DEFAULT_WARMUP} applies from "
                f"{DEFAULT_WARMUP * 10} steps)"]
    return []


def _resume(engine: Engine, src: Path, cfg: Config) -> list[str]:
    """Load the checkpoint; the lines that tell the user what was taken from where."""
    try:
        path, _ = engine.load_checkpoint(src, reset_optimizer=cfg.checkpoint.reset_optimizer)
    except CheckpointError as e:
        raise explain_failed_load(src, e, fits_run(engine, cfg)) from None
    info = engine.last_load
    engine.run_id = info.meta.get("run_id") or engine.run_id
    lines = [f"[zerotrain] resumed from {path} at step {engine.global_step}"
             + (" (resharded)" if info.resharded else "")]
    if info.optimizer_reset:
        lines.append(f"[zerotrain] optimizer state reset ({info.meta.get('optimizer')} -> "
                     f"{cfg.optimizer.name}): weights, counters and loss scale were kept")
    lines += info.notes
    if info.changes:
        lines.append("[zerotrain] warning: settings differ from the checkpoint's, this run's "
                     "config wins: " + "; ".join(info.changes))
    return lines + global_batch_change(info.meta, cfg, engine.dp_size)


def global_batch_change(meta: dict, cfg: Config, dp: int) -> list[str]:
    """A warning when the sequences per optimizer step (micro-batch × accumulation ×
    data-parallel ranks) differ from the checkpoint's run: another world size or
    sequence.parallel changes them as surely as another micro-batch does. The run keeps
    this run's settings (as for every changed setting); the line says how to keep the
    checkpoint's batch instead."""
    saved = meta.get("config") or {}
    data, seq = saved.get("data") or {}, saved.get("sequence") or {}
    try:
        old_dp = int(meta["world_size"]) // max(1, int(seq.get("parallel", 1)))
        old = int(data["micro_batch_size"]) * int(data.get("grad_accum_steps", 1)) * old_dp
    except (KeyError, TypeError, ValueError):
        return []
    mb, acc = cfg.data.micro_batch_size, cfg.data.grad_accum_steps
    new = mb * acc * dp
    if new == old:
        return [] if old_dp == dp else [
            f"[zerotrain] the global batch is kept: {new} sequences per step (micro-batch "
            f"{mb} × accumulation {acc} × {dp} data-parallel rank(s); the checkpoint's run "
            f"had {old_dp} rank(s))"]
    fixes = []
    if old % (mb * dp) == 0:
        fixes.append(f"--data.grad_accum_steps {old // (mb * dp)}")
    if old % (acc * dp) == 0 and old // (acc * dp) != mb:
        fixes.append(f"--data.micro_batch_size {old // (acc * dp)}")
    keep = (f"; to keep {old}, resume with {' or '.join(fixes)}" if fixes else "")
    return [f"[zerotrain] warning: the global batch changes from {old} sequences per step "
            f"(micro-batch {data['micro_batch_size']} × accumulation "
            f"{data.get('grad_accum_steps', 1)} × {old_dp} data-parallel rank(s)) to {new} "
            f"({mb} × {acc} × {dp}): this run trains with {new}{keep}"]
