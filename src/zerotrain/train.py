"""The training loop: config -> data -> engine -> steps, with logs, evals, checkpoints.

Readable in one sitting on purpose: `setup` builds the run, `train_step` runs one
optimizer step, `train` is the loop, `_finish` the end; what the user sees is
`report.Reporter`, the run folder's rules are `run_dir.py`, preemption and faults are
`lifecycle.py`, and everything clever lives in the engine. Every rank runs this same
code; only rank 0 reports.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerotrain.checkpoint import CheckpointError
from zerotrain.checkpoint.io import complete_checkpoints
from zerotrain.comm.dist import (
    DistInfo,
    barrier,
    init_distributed,
    patient_barrier,
    pick_device,
    shutdown,
)
from zerotrain.config import Config
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
from zerotrain.data.sampler import WindowSampler, eval_batches, to_device
from zerotrain.data.tokenizer import Tokenizer, bits_per_byte, token_byte_lengths
from zerotrain.engine import PHASE_STEPS, Engine, StepInfo
from zerotrain.fit import diagnose
from zerotrain.lifecycle import (
    Interrupted,
    Preemption,
    disk_full,
    disk_full_error,
    maybe_inject_fault,
    restart_count,
    tensor_bytes,
)
from zerotrain.memory import config_activations
from zerotrain.models import (
    build_model,
    check_weights,
    pretrained_weights,
    resolve_model_config,
)
from zerotrain.models.hf import has_weights as hf_has_weights
from zerotrain.models.sampling import generate
from zerotrain.report import Reporter, phase_text, uniform_baseline
from zerotrain.run_dir import (
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


@torch.no_grad()
def evaluate(engine: Engine, batches: Batches) -> float:
    """Mean validation loss over every rank's share of the fixed validation windows."""
    engine.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for x, y in batches:
        loss = engine(x.to(engine.device), y.to(engine.device))
        total += torch.tensor([loss.item() * len(x), len(x)], dtype=torch.float64)
    total = engine.comm.all_reduce_scalars(total)
    engine.train()
    return float(total[0] / total[1])


def val_bytes_per_token(engine: Engine, batches: Batches, tok: Tokenizer) -> float:
    """Text bytes per target token of the validation set (for bits per byte)."""
    lengths = torch.from_numpy(token_byte_lengths(tok).astype("float64"))
    local = [sum(float(lengths[y].sum()) for _, y in batches),
             float(sum(y.numel() for _, y in batches))]
    total = engine.comm.all_reduce_scalars(local)
    return float(total[0] / total[1])


@torch.no_grad()
def generate_text(engine: Engine, tok: Tokenizer, prompt: str, n_tokens: int,
                  seed: int) -> str:
    """Every rank generates with the same seed (ZeRO-3 needs all ranks in each forward)."""
    engine.eval()
    g = torch.Generator(device=engine.device).manual_seed(seed)
    idx = torch.tensor([tok.encode(prompt) or [0]], dtype=torch.long, device=engine.device)
    out = generate(engine.module, idx, n_tokens, engine.config.model.block_size, generator=g,
                   vocab_limit=tok.vocab_size)
    engine.train()
    return tok.decode(out[0].tolist())


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
    phases_said: bool = False  # the peak-memory line has been printed
    last_loss: torch.Tensor | None = None  # the latest step's mean loss (on the device)

    @property
    def global_tokens(self) -> int:
        c = self.cfg
        return (c.data.micro_batch_size * self.dist.world_size * c.data.grad_accum_steps
                * c.model.block_size)

    def save(self, val_loss: float | None = None, loss_ok: bool | None = None) -> Path:
        """A checkpoint of the current step — never of non-finite weights, nor of finite
        ones whose loss is not (`val_loss` when given, else the latest step's; `loss_ok`
        when the caller has checked): a run that diverged within its last
        train.max_skipped_steps steps ends here, not with a NaN-producing checkpoint."""
        eng = self.engine
        if not eng.strategy.weights_finite():
            raise Diverged(f"the weights are not finite at step {eng.global_step}; not "
                           f"saving them. Lower optimizer.lr (or use precision.dtype bf16) "
                           f"and {self._earlier()}")
        if val_loss is not None:
            loss_ok = math.isfinite(val_loss)
        elif loss_ok is None:
            loss_ok = self.loss_finite()
        if not loss_ok:
            what = ("the training loss is not finite" if val_loss is None
                    else f"the validation loss is {val_loss}")
            raise Diverged(f"training diverged: {what} at step {eng.global_step}, so these "
                           "weights were not saved. Lower optimizer.lr (or use precision."
                           f"dtype bf16) and {self._earlier()}")
        try:
            return eng.save_checkpoint(self.ckpt_root)
        except Exception as e:  # safetensors' SafetensorError is no OSError
            if not disk_full(e):
                raise
            raise disk_full_error(e, self.ckpt_root, eng.global_step,
                                  tensor_bytes(eng.state_dict())) from None

    def loss_finite(self) -> bool:
        """Whether the latest step's loss was finite on every rank (the same answer on
        all of them: they save together or not at all)."""
        if self.last_loss is None:
            return True
        flag = float(not bool(torch.isfinite(self.last_loss)))
        if self.dist.world_size > 1:
            flag = float(self.engine.comm.all_reduce_scalars([flag], op="max")[0])
        return flag == 0

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
    cfg = cfg.model_copy(update={"model": model_cfg})
    train_src, val_src = load_splits(path, tok, d.val_fraction, d.text_field)
    T = model_cfg.block_size
    sampler = WindowSampler(train_src, T, cfg.train.seed)
    val = eval_batches(val_src, T, rank, world, d.micro_batch_size, cfg.logging.eval_batches)
    summary = (f"[zerotrain] data: {describe(path, tok)}; {sampler.n_windows:,} training "
               f"windows of {T + 1} tokens") if rank == 0 else ""
    return Data(cfg, tok, sampler, val, summary, notes if rank == 0 else [])


def check_before_launch(cfg: Config, resume: str | None, world: int) -> None:
    """What the launcher checks before starting ranks: devices, run folder and data
    (made here once: the ranks then find the tokenizer and token shards ready)."""
    pick_device(cfg.train.device, 0, local_world=world)
    check_weights(cfg.model)
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
    data = load_data(cfg, info.rank, info.world_size, drop_caches=drops_caches(cfg, src))
    cfg = data.cfg
    engine = build(cfg, info.device)
    engine.extra_meta["tokenizer"] = data.tokenizer.describe()
    engine.run_id = new_run_id()
    run_dir = Path(cfg.logging.run_dir)
    lines = _resume(engine, src, cfg) if src is not None else []
    barrier()  # every rank has checked the folder before rank 0 may clear it
    if src is None and info.rank == 0:
        clear_run(cfg)  # what an earlier, unresumable attempt or --logging.overwrite left
    barrier()
    report = Reporter(cfg, run_dir, info.rank, engine.global_step,
                      engine.global_step if src is not None else None)
    if src is None and resume == "auto":  # say so: the user may have expected a resume
        why = f"restart {restart_count()}" if restart_count() else "--resume auto"
        lines.append(f"[zerotrain] {why}: no complete checkpoint in {checkpoint_root(cfg)}; "
                     "starting a new run from step 0")
    for line in [data.summary, *data.notes, *_default_notes(cfg), *lines]:
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
    if info.changes:
        lines.append("[zerotrain] warning: settings differ from the checkpoint's, this run's "
                     "config wins: " + "; ".join(info.changes))
    return lines


def train_step(run: Run) -> tuple[StepInfo, torch.Tensor, float]:
    """One optimizer step over `grad_accum_steps` micro-batches: (info, mean loss as a
    float64 0-d tensor on the device, seconds). The loss stays on the device — reading
    it (`float(loss)`) waits for the GPU, so only log steps do."""
    eng, d, c = run.engine, run.dist, run.cfg
    step, accum = eng.global_step, c.data.grad_accum_steps
    t0 = time.perf_counter()
    loss_sum = torch.zeros((), dtype=torch.float64, device=d.device)
    sinfo = None
    for m in range(accum):
        x, y = run.sampler.batch(step, m, d.rank, d.world_size, c.data.micro_batch_size, accum)
        loss = eng(to_device(x, d.device), to_device(y, d.device))
        eng.backward(loss)
        sinfo = eng.step()
        loss_sum += loss.detach()  # fp32 -> fp64 exactly: the sum of loss.item()s
    assert sinfo is not None
    return sinfo, loss_sum / accum, time.perf_counter() - t0


def _start_lines(run: Run) -> None:
    eng = run.engine
    mem = eng.memory_report()
    run.report.record({"type": "memory", "step": eng.global_step, **mem})
    ms = mem["model_states"]
    n_params = sum(p.numel() for p in eng.module.parameters())
    run.report.say(f"[zerotrain] {run.dist.world_size} rank(s), {eng.strategy.name}, "
                   f"{n_params:,} params, {eng.policy.describe()}")
    run.report.say("[zerotrain] model states on rank 0 (bytes): " + ", ".join(
        f"{place} {k}={v:,}" for place in ("device", "host") for k, v in ms[place].items()
        if v))
    if eng.strategy.muon is not None:  # distributed Muon: who updates which matrices
        run.report.say(f"[zerotrain] {eng.strategy.muon.describe()}")
    if run.dist.device.type == "cpu":
        warning = cpu_cost_warning(run.cfg, n_params)
        if warning:
            run.report.say(warning)


#: what a CPU rank computes per second, roughly (a few cores of fp32 matmul)
CPU_FLOPS = 1e11


def cpu_cost_warning(cfg: Config, n_params: int) -> str | None:
    """A warning when one step would take minutes on a CPU: the matmuls (6 FLOPs per
    parameter per token) and attention, which grows with block_size² (12·L·h·s² per
    sequence, forward and backward). Said before the first step, which may never end."""
    m, d = cfg.model, cfg.data
    seqs = d.micro_batch_size * d.grad_accum_steps
    s, h, layers = m.block_size, m.n_embd or 0, m.n_layer or 0
    flops = 6 * n_params * seqs * s + 12 * layers * h * seqs * s * s
    seconds = flops / CPU_FLOPS
    if seconds < 60:
        return None
    return (f"[zerotrain] warning: one step is about {flops:.1e} FLOPs on each rank "
            f"(attention grows with model.block_size² = {s}²); at the ~{CPU_FLOPS:.0e} "
            f"FLOP/s of a CPU that is about {seconds / 60:.0f} min per step; lower "
            "model.block_size or data.micro_batch_size, or train on a GPU")


def _phase_line(run: Run) -> None:
    """Peak memory per phase against the model's prediction (rank 0's numbers)."""
    eng, c = run.engine, run.cfg
    # every family's activations are modelled (memory/activations.py)
    acts, modelled = config_activations(c, device=eng.device.type).peak, True
    ph = eng.memory_phases(acts)
    run.report.record({"type": "memory_phases", "step": eng.global_step,
                       "activations_modelled": modelled, **ph})
    # said once: after the first steps, or at the end of a run that never got there
    if not run.phases_said:
        run.phases_said = True
        run.report.say(phase_text(ph, modelled, eng.device.type == "cpu"))


def _log_step(run: Run, sinfo: StepInfo, loss: torch.Tensor, dt: float) -> float:
    eng, world = run.engine, run.dist.world_size
    loss_avg = float(eng.comm.all_reduce_scalars(loss.reshape(1))[0]) / world
    rec = {"type": "train", "step": eng.global_step, "loss": loss_avg, "lr": sinfo.lr,
           "grad_norm": sinfo.grad_norm, "tokens_per_s": run.global_tokens / dt,
           "step_time_s": dt, "loss_scale": sinfo.loss_scale,
           "skipped_total": sinfo.skipped_total, "bytes_sent": eng.last_traffic_bytes[0]}
    if sinfo.fp8 is not None:  # FP8 overflow/underflow counts per tensor class, this step
        rec["fp8"] = sinfo.fp8
    run.report.train_step(rec, eng.policy.loss_scaling)
    return loss_avg


class _Watch:
    """Per-step checks that stop a run: divergence, preemption, injected faults.

    Preemption at several ranks: every rank must stop at the same step boundary, so the
    flag is voted on (a MAX all-reduce). A blocking vote every step would drain the
    device queue at each step boundary (host → device, NCCL, device → host), so the
    vote is asynchronous: cast at step k, read at step k + 1, where the run stops (one
    step after the signal instead of at once — a preemption's grace period is seconds
    to minutes; a step is well under that)."""

    def __init__(self, run: Run, preemption: Preemption):
        self.run, self.preemption = run, preemption
        self.in_a_row = 0
        self._vote: Callable[[], float] | None = None  # the last vote's result, when ready

    def after_step(self, sinfo: StepInfo) -> None:
        run, cfg = self.run, self.run.cfg
        step = run.engine.global_step
        if sinfo.spike:
            run.report.say(f"[zerotrain] step {step} skipped by the spike guard: {sinfo.spike}")
        self.in_a_row = self.in_a_row + 1 if sinfo.skipped and not sinfo.spike else 0
        if self.in_a_row >= cfg.train.max_skipped_steps:
            raise Diverged(f"{self.in_a_row} optimizer steps in a row had non-finite "
                           f"gradients (up to step {step}); training has diverged. Lower "
                           f"optimizer.lr and {run._earlier()} (train.max_skipped_steps "
                           "sets this limit)")
        maybe_inject_fault(cfg.train.fault, run.dist.rank, step)
        if run.dist.world_size > 1:  # every rank stops at the same step boundary
            stop = self.finish() > 0  # the vote cast at the previous step
            if not stop:
                self._cast(self.preemption.requested)
        else:
            stop = self.preemption.requested
        if stop:
            path = run.save()
            run.report.close()
            raise Interrupted(step, str(path))


    def _cast(self, flag: bool) -> None:
        """Start this step's preemption vote (SUM of 0/1 flags) without waiting for it."""
        comm = self.run.engine.comm
        votes = torch.full((1,), float(flag), dtype=torch.float32, device=comm.device)
        handle = comm.all_reduce(votes, purpose="control", async_op=True)
        if comm.device.type == "cuda":  # the stream waits for NCCL, the host does not
            handle.wait()
            host = torch.empty(1, dtype=torch.float32, pin_memory=True)
            host.copy_(votes, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record()
            self._vote = lambda: (landed.synchronize(), float(host[0]))[1]
        else:  # gloo: the work runs on its own thread until waited for
            self._vote = lambda: (handle.wait(), float(votes[0]))[1]

    def finish(self) -> float:
        """The number of ranks asking to stop at the last vote (0 when none is pending);
        called at the end of the loop too, so no vote is left in flight."""
        vote, self._vote = self._vote, None
        return vote() if vote is not None else 0.0


def _validate(run: Run, step: int) -> float:
    v = evaluate(run.engine, run.val_set)
    run.report.record({"type": "val", "step": step, "val_loss": v,
                       "val_bits_per_byte": bits_per_byte(v, run.val_bpt)})
    return v


def train(cfg: Config, resume: str | None = None) -> dict[str, Any]:
    """Train; the process group is closed afterwards if this call opened it."""
    run = setup(cfg, resume)
    summary = _train(run)
    if run.dist.owns_group:  # a caller's own group (tests, notebooks) stays theirs
        shutdown()
    return summary


def _train(run: Run) -> dict[str, Any]:
    cfg, eng, report = run.cfg, run.engine, run.report
    if run.resumed and eng.global_step >= cfg.train.steps:
        report.say(f"[zerotrain] the run is already complete at step {eng.global_step} "
                   f"(train.steps {cfg.train.steps}); raise train.steps to continue it")
        report.close()
        eng.close()
        return {"type": "summary", "step": eng.global_step, "steps_run": 0}
    _start_lines(run)
    first_val = None
    if eng.global_step == 0 and cfg.logging.eval_every:
        first_val = _validate(run, 0)
    t_start = time.perf_counter()
    steps_run, loss_avg = 0, float("nan")
    with Preemption() as preemption, report.bar_closed_on_error():
        watch = _Watch(run, preemption)
        while eng.global_step < cfg.train.steps:
            sinfo, loss, dt = train_step(run)
            run.last_loss = loss
            steps_run += 1
            last = eng.global_step
            if last % cfg.logging.log_every == 0 or last == cfg.train.steps:
                loss_avg = _log_step(run, sinfo, loss, dt)
            report.advance()
            if last == PHASE_STEPS:
                _phase_line(run)
            watch.after_step(sinfo)
            if cfg.logging.eval_every and last % cfg.logging.eval_every == 0 \
                    and last != cfg.train.steps:
                v = _validate(run, last)
                report.say(f"step {last}: validation loss {v:.4f}, "
                           f"{bits_per_byte(v, run.val_bpt):.4f} bits/byte")
            if cfg.checkpoint.every and last % cfg.checkpoint.every == 0 \
                    and last != cfg.train.steps:
                if run.loss_finite():
                    report.say(f"[zerotrain] step {last}: checkpoint "
                               f"{run.save(loss_ok=True)}")
                else:  # weights that give a non-finite loss are no point to resume from
                    report.say(f"[zerotrain] step {last}: no checkpoint, the loss is not "
                               "finite (the spike guard or train.max_skipped_steps decides "
                               "whether training goes on)")
        watch.finish()
    report.close_bar()
    elapsed = time.perf_counter() - t_start
    return _finish(run, first_val, loss_avg, steps_run, elapsed)


def _finish(run: Run, first_val: float | None, loss_avg: float, steps_run: int,
            elapsed: float) -> dict[str, Any]:
    cfg, eng, report = run.cfg, run.engine, run.report
    final_val = _validate(run, eng.global_step)
    ckpt = run.save(val_loss=final_val)
    _phase_line(run)
    sample = ""
    if cfg.logging.sample_tokens:
        sample = generate_text(eng, run.tokenizer, "def ", cfg.logging.sample_tokens,
                               cfg.train.seed)
    summary = {
        "type": "summary", "step": eng.global_step, "steps_run": steps_run,
        "first_val_loss": first_val, "final_val_loss": final_val, "final_train_loss": loss_avg,
        "final_val_bits_per_byte": bits_per_byte(final_val, run.val_bpt),
        "seconds": elapsed,
        "tokens_per_s": steps_run * run.global_tokens / max(elapsed, 1e-9),
        "skipped_steps": eng.last_info.skipped_total if eng.last_info else 0,
        "checkpoint": str(ckpt), "world_size": run.dist.world_size,
        "strategy": eng.strategy.name,
    }
    fit = diagnose(report.log.records)  # the train–validation gap, its trend, a verdict
    summary.update(fit.record())
    report.record(summary)
    baseline, label = uniform_baseline(cfg.model.vocab_size)
    if cfg.logging.plot:
        report.plot(baseline, label)
    if sample and report.enabled:
        (run.run_dir / "sample.txt").write_text(sample)
        report.say("\n----- sample -----\n" + sample + "\n------------------")
    fv = f"{first_val:.4f} -> " if first_val is not None else ""
    report.say(f"[zerotrain] validation loss {fv}{final_val:.4f} ({label.split(' (')[0]} = "
               f"{baseline:.4f}), {bits_per_byte(final_val, run.val_bpt):.4f} bits/byte; "
               f"{fit.gap_text()}; {steps_run} steps in {elapsed:.1f}s; checkpoint {ckpt}; "
               f"metrics {', '.join(report.log.where) or 'not written (logging.backends [])'}")
    report.say(fit.line())
    report.close()
    barrier()
    eng.close()
    return summary
