"""The training loop: config -> data -> engine -> steps, with logs, evals, checkpoints.

Readable in one sitting on purpose: `setup` builds the run, `train_step` runs one
optimizer step, `train` is the loop; what the user sees is `report.Reporter`, and
everything clever lives in the engine. Every rank runs this same code; only rank 0
reports.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerotrain.checkpoint import CheckpointError, resolve
from zerotrain.comm.dist import DistInfo, barrier, init_distributed
from zerotrain.config import Config
from zerotrain.data.corpus import DataError, decode, encode, load_tokens, train_val_split
from zerotrain.data.sampler import WindowSampler, eval_batches
from zerotrain.engine import Engine, StepInfo
from zerotrain.models.gpt import GPT
from zerotrain.report import Reporter, uniform_baseline


def _threads(cfg: Config) -> int:
    if cfg.train.threads:
        return cfg.train.threads
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, (os.cpu_count() or 1) // local)


@torch.no_grad()
def evaluate(engine: Engine, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean validation loss over every rank's share of the fixed validation windows."""
    engine.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for x, y in batches:
        loss = engine(x.to(engine.device), y.to(engine.device))
        total += torch.tensor([loss.item() * len(x), len(x)], dtype=torch.float64)
    total = engine.comm.all_reduce_scalars(total)
    engine.train()
    return float(total[0] / total[1])


@torch.no_grad()
def generate_text(engine: Engine, prompt: str, n_tokens: int, seed: int) -> str:
    """Every rank generates with the same seed (ZeRO-3 needs all ranks in each forward)."""
    engine.eval()
    g = torch.Generator(device=engine.device).manual_seed(seed)
    idx = torch.from_numpy(encode(prompt).astype("int64"))[None].to(engine.device)
    out = engine.module.generate(idx, n_tokens, generator=g)
    engine.train()
    return decode(out[0].tolist())


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

    @property
    def global_tokens(self) -> int:
        c = self.cfg
        return (c.data.micro_batch_size * self.dist.world_size * c.data.grad_accum_steps
                * c.model.block_size)


def setup(cfg: Config, resume: str | None) -> Run:
    info = init_distributed(cfg.train.device, cfg.comm.backend, cfg.comm.timeout_s)
    torch.set_num_threads(_threads(cfg))
    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank
    tokens = load_tokens(cfg.data.path)
    if int(tokens.max()) >= cfg.model.vocab_size:
        raise DataError(f"data holds token id {int(tokens.max())} but model.vocab_size is "
                        f"{cfg.model.vocab_size}; raise model.vocab_size")
    train_tok, val_tok = train_val_split(tokens, cfg.data.val_fraction)
    T, mbs = cfg.model.block_size, cfg.data.micro_batch_size
    sampler = WindowSampler(train_tok, T, cfg.train.seed)
    val_set = eval_batches(val_tok, T, info.rank, info.world_size, mbs, cfg.logging.eval_batches)
    engine = Engine(GPT(cfg.model), cfg, info.device)
    run_dir = Path(cfg.logging.run_dir)
    ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    if resume is not None:
        src = ckpt_root if resume in ("", "latest") else Path(resume)
        try:
            resolve(src)
        except CheckpointError as e:
            raise CheckpointError(f"--resume: {e}") from None
        engine.load_checkpoint(src)
    report = Reporter(cfg, run_dir, info.rank, engine.global_step,
                      engine.global_step if resume is not None else None)
    if info.rank == 0:
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    return Run(cfg, info, engine, sampler, val_set, run_dir, ckpt_root, report)


def train_step(run: Run) -> tuple[StepInfo, float, float]:
    """One optimizer step over `grad_accum_steps` micro-batches: (info, mean loss, seconds)."""
    eng, d, c = run.engine, run.dist, run.cfg
    step, accum = eng.global_step, c.data.grad_accum_steps
    t0 = time.perf_counter()
    loss_sum = 0.0
    sinfo = None
    for m in range(accum):
        x, y = run.sampler.batch(step, m, d.rank, d.world_size, c.data.micro_batch_size, accum)
        loss = eng(x.to(d.device), y.to(d.device))
        eng.backward(loss)
        sinfo = eng.step()
        loss_sum += loss.item()
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


def _log_step(run: Run, sinfo: StepInfo, loss: float, dt: float) -> float:
    eng, world = run.engine, run.dist.world_size
    loss_avg = float(eng.comm.all_reduce_scalars([loss])[0]) / world
    rec = {"type": "train", "step": eng.global_step, "loss": loss_avg, "lr": sinfo.lr,
           "grad_norm": sinfo.grad_norm, "tokens_per_s": run.global_tokens / dt,
           "step_time_s": dt, "loss_scale": sinfo.loss_scale,
           "skipped_total": sinfo.skipped_total, "bytes_sent": eng.last_traffic_bytes[0]}
    run.report.train_step(rec, eng.policy.loss_scaling)
    return loss_avg


def train(cfg: Config, resume: str | None = None) -> dict[str, Any]:
    run = setup(cfg, resume)
    eng, report = run.engine, run.report
    _start_lines(run)
    first_val = None
    if eng.global_step == 0 and cfg.logging.eval_every:
        first_val = evaluate(eng, run.val_set)
        report.record({"type": "val", "step": 0, "val_loss": first_val})
    t_start = time.perf_counter()
    steps_run, loss_avg = 0, float("nan")
    while eng.global_step < cfg.train.steps:
        sinfo, loss, dt = train_step(run)
        steps_run += 1
        last = eng.global_step
        if last % cfg.logging.log_every == 0 or last == cfg.train.steps:
            loss_avg = _log_step(run, sinfo, loss, dt)
        report.advance()
        if cfg.logging.eval_every and last % cfg.logging.eval_every == 0 \
                and last != cfg.train.steps:
            v = evaluate(eng, run.val_set)
            report.record({"type": "val", "step": last, "val_loss": v})
            report.say(f"step {last}: validation loss {v:.4f}")
        if cfg.checkpoint.every and last % cfg.checkpoint.every == 0 and last != cfg.train.steps:
            eng.save_checkpoint(run.ckpt_root)
    report.close_bar()
    elapsed = time.perf_counter() - t_start
    return _finish(run, first_val, loss_avg, steps_run, elapsed)


def _finish(run: Run, first_val: float | None, loss_avg: float, steps_run: int,
            elapsed: float) -> dict[str, Any]:
    cfg, eng, report = run.cfg, run.engine, run.report
    final_val = evaluate(eng, run.val_set)
    report.record({"type": "val", "step": eng.global_step, "val_loss": final_val})
    ckpt = eng.save_checkpoint(run.ckpt_root)
    sample = ""
    if cfg.logging.sample_tokens:
        sample = generate_text(eng, "def ", cfg.logging.sample_tokens, cfg.train.seed)
    summary = {
        "type": "summary", "step": eng.global_step, "steps_run": steps_run,
        "first_val_loss": first_val, "final_val_loss": final_val, "final_train_loss": loss_avg,
        "seconds": elapsed,
        "tokens_per_s": steps_run * run.global_tokens / max(elapsed, 1e-9),
        "skipped_steps": eng.scaler.skipped, "checkpoint": str(ckpt),
        "world_size": run.dist.world_size, "strategy": eng.strategy.name,
    }
    report.record(summary)
    baseline, label = uniform_baseline(cfg.model.vocab_size)
    if cfg.logging.plot:
        report.plot(baseline, label)
    if sample and report.enabled:
        (run.run_dir / "sample.txt").write_text(sample)
        report.say("\n----- sample -----\n" + sample + "\n------------------")
    fv = f"{first_val:.4f} -> " if first_val is not None else ""
    report.say(f"[zerotrain] validation loss {fv}{final_val:.4f} ({label.split(' (')[0]} = "
               f"{baseline:.4f}); {steps_run} steps in {elapsed:.1f}s; checkpoint {ckpt}; "
               f"metrics {run.run_dir / 'metrics.jsonl'}")
    report.close()
    barrier()
    eng.close()
    return summary
